"""Edits of the package's paged prefill kernel and register caps, timed on a GPU (Qwen3-0.6B's heads, blocks of 16
scattered in the cache), each against an uncapped kernel in the same run.

    python tools/prefill_kernel_edits.py OUT.json          # the edits, on the 16,384-token prefill (16 x 1,024)
    python tools/prefill_kernel_edits.py OUT.json --caps   # register caps by tile shape, on three shapes

Each edit is applied to a copy of minivllm/kernels/paged_prefill_kernel.py (imported from a temporary file, the
launcher pointed at it): `scale_fma` keeps the scores unscaled and folds the scale into the exponent (one fused
multiply-add per score, the running maximum in scaled units), `reverse` runs the query blocks last to first (a
sequence's longest rows first), `maxnreg128` caps the registers at 128 a thread. `plain` is the kernel over plain k
and v [tokens, kv_heads, dim] instead of the paged cache (`varlen_prefill_attention`): what the paging costs. Every
output is checked against the first configuration's. The cap: compiled for sm_90, a program of 128 x 64 tiles and 8
warps takes 176 registers a thread (ptxas -v), so it holds an SM alone; under 128 two share one, at a few spilled
bytes. The launcher applies `PREFILL_MAX_REGISTERS` (128 since 4cda30e), which this tool sets per run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import import_source, kernel_source  # noqa: E402
from prefill_sweep import DIM, causal_flops, make_step  # noqa: E402

from minivllm.bench import environment  # noqa: E402
from minivllm.kernels import paged_prefill as pp  # noqa: E402

KERNEL = os.path.join(os.path.dirname(pp.__file__), "paged_prefill_kernel.py")
EXTRA = """

@triton.jit
def osu_scaled(m_i, l_i, acc, s, v, qk_scale, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
"""
EDITS = {
    "scale_fma": [
        (
            "s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale",
            "s = tl.dot(q, k, input_precision=DOT_PRECISION)",
        ),
        (
            "online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)",
            "osu_scaled(m_i, l_i, acc, s, v, qk_scale, DOT_PRECISION)",
        ),
    ],
    "reverse": [
        (
            "q_block, kv_head = tl.program_id(0), tl.program_id(1)",
            "q_block, kv_head = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)",
        )
    ],
}
VARIANTS = {
    "package": [],
    "scale_fma": ["scale_fma"],
    "reverse": ["reverse"],
    "maxnreg128": [],  # (the package's launcher passes its cap, PREFILL_MAX_REGISTERS: None for the others here)
    "reverse+maxnreg128": ["reverse"],
}
CONFIGS = [(128, 32, 8, 3), (128, 32, 8, 2), (128, 64, 8, 2)]


def make(name: str, edits: list[str]):
    src = kernel_source(KERNEL) + EXTRA
    for edit in edits:
        for old, new in EDITS[edit]:
            assert src.count(old) == 1, f"the kernel no longer holds: {old}"
            src = src.replace(old, new)
    return import_source(src, f"prefill_{name}")._paged_prefill_kernel


def plain_kv(kc, vc, block_tables, ctx_lens):
    "The paged cache's keys and values in plain [tokens, kv_heads, dim] rows, sequence after sequence."
    page = kc.shape[1]
    rows = [
        b * page + r for t, n in zip(block_tables.tolist(), ctx_lens) for b in t[: -(-n // page)] for r in range(page)
    ]
    starts = [sum(-(-n // page) * page for n in ctx_lens[:i]) for i in range(len(ctx_lens))]
    keep = torch.tensor([s + p for s, n in zip(starts, ctx_lens) for p in range(n)])
    idx = torch.tensor(rows)[keep].to(kc.device)
    return kc.flatten(0, 1)[idx].contiguous(), vc.flatten(0, 1)[idx].contiguous()


def runners(q, kc, vc, m, ctx_lens):
    "(paged, plain): the package's launcher over the paged cache, and over the same keys and values plain."
    k, v = plain_kv(kc, vc, m.block_tables, ctx_lens)
    cu_k = torch.zeros(len(ctx_lens) + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.tensor(ctx_lens).cumsum(0)
    lens, scale = m.context_lens, DIM**-0.5

    def paged(bm, bn, w, s):
        return pp._launch_prefill(
            q, kc, vc, m.cu_seqlens_q, lens, lens, m.block_tables, scale, kc.shape[1], True, bm, bn, None, False, w, s
        )

    def plain(bm, bn, w, s):
        return pp._launch_prefill(q, k, v, m.cu_seqlens_q, cu_k, lens, cu_k, scale, 1, False, bm, bn, None, False, w, s)

    return paged, plain


CAP_SHAPES = {  # (query lengths, context lengths): prompts only, and one prompt beside 255 decodes (skip_single)
    "prefill 16x1024": ([1024] * 16, [1024] * 16),
    "prefill 4x4096": ([4096] * 4, [4096] * 4),
    "mixed 255+256": ([1] * 255 + [256], [1024] * 255 + [256]),
}
CAP_CONFIGS = [  # (block_m, block_n, num_warps, num_stages, maxnreg)
    (128, 32, 8, 3, None),
    (128, 64, 8, 2, 128),
    (128, 64, 8, 3, 128),
    (64, 64, 4, 2, 128),
    (64, 64, 4, 3, 128),
    (64, 32, 4, 3, 128),
    (128, 64, 4, 2, 255),
    (128, 128, 8, 2, 128),
    (128, 32, 8, 3, 96),
]


def timed(run, ref) -> tuple[float, float]:
    "(microseconds, max abs difference from `ref`) of `run`."
    err = (run().float() - ref).abs().max().item()
    return triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median") * 1e3, err


def edits_run() -> list[dict]:
    "Each variant at each of CONFIGS on the 16,384-token prefill, uncapped unless named `maxnreg128`."
    q_lens = ctx_lens = [1024] * 16
    q, kc, vc, m = make_step(q_lens, ctx_lens)
    flops = causal_flops(q_lens, ctx_lens)
    paged, plain = runners(q, kc, vc, m, ctx_lens)
    orig, results = pp._paged_prefill_kernel, []
    pp.PREFILL_MAX_REGISTERS = None
    ref = paged(*CONFIGS[0]).float()
    kernels = {name: orig if not edits else make(name, edits) for name, edits in VARIANTS.items()}
    for cfg in CONFIGS:
        for name in list(VARIANTS) + ["plain"]:
            pp._paged_prefill_kernel = kernels.get(name, orig)
            pp.PREFILL_MAX_REGISTERS = 128 if name.endswith("maxnreg128") else None
            try:
                us, err = timed(functools.partial(plain if name == "plain" else paged, *cfg), ref)
            except Exception as e:  # (shared memory: a configuration that does not fit)
                print(name, cfg, type(e).__name__, str(e)[:200], flush=True)
                continue
            bm, bn, w, s = cfg
            row = dict(variant=name, block_m=bm, block_n=bn, num_warps=w, num_stages=s, us=us)
            row.update(tflops=flops / us / 1e6, max_diff=err)
            results.append(row)
            print(json.dumps(row), flush=True)
    pp._paged_prefill_kernel = orig
    return results


def capped(step, skip, rows, bm, bn, w, s, cap):
    "The package's prefill on `step` (from `make_step`) at these tiles, under the register cap `cap`."
    q, kc, vc, m = step
    pp.PREFILL_MAX_REGISTERS = cap
    out = pp.paged_prefill_attention(
        q,
        kc,
        vc,
        m.cu_seqlens_q,
        m.context_lens,
        m.block_tables,
        DIM**-0.5,
        skip_single=skip,
        block_m=bm,
        block_n=bn,
        num_warps=w,
        num_stages=s,
    )
    return out[rows]


def caps_run() -> list[dict]:
    "The package's kernel at each of CAP_CONFIGS on each of CAP_SHAPES, against the uncapped 128 / 32 / 8 / 3."
    results = []
    for shape, (q_lens, ctx_lens) in CAP_SHAPES.items():
        q, kc, vc, m = make_step(q_lens, ctx_lens)
        flops, skip = causal_flops(q_lens, ctx_lens), q_lens[0] == 1
        rows = slice(len(q_lens) - 1, None) if skip else slice(None)  # (skipped rows stay unwritten)

        run = functools.partial(capped, (q, kc, vc, m), skip, rows)
        ref = run(*CAP_CONFIGS[0]).float()
        for cfg in CAP_CONFIGS:
            try:
                us, err = timed(functools.partial(run, *cfg), ref)
            except Exception as e:  # (shared memory: a configuration that does not fit)
                print(shape, cfg, type(e).__name__, flush=True)
                continue
            bm, bn, w, s, cap = cfg
            row = dict(shape=shape, block_m=bm, block_n=bn, num_warps=w, num_stages=s, maxnreg=cap, us=us)
            row.update(tflops=flops / us / 1e6, max_diff=err)
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--caps", action="store_true", help="the register caps by tile shape, on three shapes")
    args = ap.parse_args()
    cap = pp.PREFILL_MAX_REGISTERS
    try:
        results = caps_run() if args.caps else edits_run()
    finally:
        pp.PREFILL_MAX_REGISTERS = cap
    shape = "three shapes" if args.caps else "prefill 16x1024"
    with open(args.out, "w") as f:
        json.dump(dict(environment=environment(), shape=shape, results=results), f, indent=1)


if __name__ == "__main__":
    main()
