"""Small edits of the package's decode kernel, timed on a GPU through `paged_decode_attention` (bench_decode, CUDA
graph replays), for an 8-bit and a bfloat16 cache, beside `tools/decode_fp8_variants.py`'s float16 kernel.

    python tools/decode_kernel_edits.py OUT.json

Each edit is applied to a copy of minivllm/kernels/paged_decode_kernel.py (the copy imported from a temporary file,
the launcher pointed at it): `lazy_v` converts the value tile at the P.V product rather than right after its load;
`no_mask` loads K and V without the head-dim mask (exact while head_dim is a power of two); `all` adds `valid` without
the shared-prefix bound when there is no cascade. The question: why the package's kernel gains less from float16 tiles
than the standalone one. All three are in the package since 5be7047 (the package's kernel compiles to the same PTX
as `all`): the figure of this run (figures/52_decode_kernel_edits_h100.json) edited the kernel before them, which
`--kernel` takes again:

    git show 8b821e5:minivllm/kernels/paged_decode_kernel.py > old_decode_kernel.py
    python tools/decode_kernel_edits.py OUT.json --kernel old_decode_kernel.py

A variant whose edit no longer matches the kernel's source is left out, with a line saying so.
"""

import argparse
import json
import os
import sys
from functools import partial

import torch
import triton.testing

import minivllm.kernels.paged_decode as pd
from minivllm.kernels.bench import bench_decode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_fp8_variants as fv  # noqa: E402
from kernel_variants import import_source, kernel_source  # noqa: E402

PACKAGE_KERNEL = os.path.join(os.path.dirname(pd.__file__), "paged_decode_kernel.py")


EXTRA = """

@triton.jit
def load_kv_nomask(kv, block, row, valid):
    k_ptr, v_ptr, sk, sv, kv_head, dims, dim_mask = kv
    k_rows = block * sk[0] + row * sk[1] + kv_head * sk[2]
    v_rows = block * sv[0] + row * sv[1] + kv_head * sv[2]
    k = tl.load(k_ptr + k_rows[None, :] + dims[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def osu_lazy(m_i, l_i, acc, s, v, q, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha, p = tl.exp2(m_i - m_new), tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc
"""


class Unmatched(Exception):
    "An edit's text is not in the kernel's source (the kernel changed since)."


def edit(s, old, new):
    if s.count(old) != 1:
        raise Unmatched(old.strip())
    return s.replace(old, new)


def make(src, name, lazy_v, no_mask, no_kvstart):
    s = src + EXTRA
    if lazy_v:
        s = edit(s, "        k, v = k.to(q.dtype), v.to(q.dtype)", "        k = k.to(q.dtype)")
        s = edit(
            s,
            "online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)",
            "osu_lazy(m_i, l_i, acc, s, v, q, DOT_PRECISION)",
        )
    if no_mask:
        s = edit(
            s,
            "k, v = load_kv_tile(kv, block, pos % PAGE_SIZE, valid)",
            "k, v = load_kv_nomask(kv, block, pos % PAGE_SIZE, valid)",
        )
    if no_kvstart:
        s = edit(
            s,
            "valid = (pos >= kv_start) & (pos < context_len)",
            "valid = ((pos >= kv_start) & (pos < context_len)) if CASCADE else (pos < context_len)",
        )
    return import_source(s, f"pv_{name}")._paged_decode_kernel


VARIANTS = {"package": None, "lazy_v": (1, 0, 0), "no_mask": (0, 1, 0), "lazy_v+no_mask": (1, 1, 0), "all": (1, 1, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument(
        "--kernel", default=PACKAGE_KERNEL, help="the decode kernel's module to edit (default: the package's)"
    )
    args = ap.parse_args()
    src = kernel_source(args.kernel)
    orig = pd._paged_decode_kernel if args.kernel == PACKAGE_KERNEL else make(src, "given", 0, 0, 0)
    results = []
    fp8 = torch.float8_e4m3fn
    for shape in [(256, 512), (512, 768), (32, 1024), (8, 4096)]:
        for name, flags in VARIANTS.items():
            try:
                pd._paged_decode_kernel = orig if flags is None else make(src, name, *flags)
            except Unmatched as e:
                print(f"{name}: left out, the kernel no longer holds {e}", flush=True)
                continue
            for cache in ("fp8", "bf16"):
                if cache == "bf16" and name in ("lazy_v",):
                    continue
                try:
                    r = bench_decode(
                        batch=shape[0], context=shape[1], cuda_graph=True, cache_dtype=fp8 if cache == "fp8" else None
                    )
                except Exception as e:
                    print("fail", name, cache, type(e).__name__, str(e)[:300], flush=True)
                    continue
                row = dict(
                    batch=shape[0], context=shape[1], variant=name, cache=cache, us=r["ms"] * 1e3, gbps=r["gbps"]
                )
                results.append(row)
                print(json.dumps(row), flush=True)
        json.dump(dict(gpu=torch.cuda.get_device_name(), results=results), open(args.out, "w"))

    pd._paged_decode_kernel = orig

    for shape in [(256, 512), (512, 768), (32, 1024), (8, 4096)]:
        q, kc, vc, lens, tables = fv.make(shape[0], shape[1], fp8)
        out = torch.empty_like(q)
        cfg = dict(mode=1, prefetch=0, kt=1, qk_fp8=0, block_n=128, warps=4, stages=2)
        run = partial(fv.variant, q, kc, vc, lens, tables, 128**-0.5, out, **cfg)
        ms = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")
        row = dict(batch=shape[0], context=shape[1], variant="experiment mode 1", cache="fp8", us=ms * 1e3)
        results.append(row)
        print(json.dumps(row), flush=True)
    json.dump(dict(gpu=torch.cuda.get_device_name(), results=results), open(args.out, "w"))


if __name__ == "__main__":
    main()
