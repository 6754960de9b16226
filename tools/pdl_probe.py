"""Programmatic dependent launch (PDL) on a GPU: a decode step's kernels at batch 1, launched plainly and early.

    python tools/pdl_probe.py --out figures/06_pdl_probe_h200.json

Two measurements, each a CUDA graph of one step over 28 layers of Qwen3-0.6B's shapes (random bfloat16 weights, so
nothing stays in L2), replayed and timed (median), with the results' bits compared between launches:
- `products`: only the four one-row products of each layer (norm + qkv_proj, o_proj, norm + gate_up_proj with the
  activation, down_proj), by a copy of `norm_gemv`'s kernel that takes all of a row in one tile. Mode `plain`: no PDL;
  `wait_first`: PDL, each program waits before any load; `weights_first`: PDL, the weights are loaded before the wait.
- `package`: the package's own kernels of a decode step (norm_gemv,
  qk_norm_rope_store, the decode kernel and its merge, gemv; `decode_step_kernels` below, also run by
  tests/test_kernels.py) with `ENABLE_PDL` off and on (launched early, `gemv` sums a row in one tile, so the two
  agree to rounding: their largest difference is reported).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minivllm.kernels.gemv import gemv, norm_gemv
from minivllm.kernels.paged_decode import paged_decode_attention
from minivllm.kernels.qk_norm_rope import qk_norm_rope_store

LAYERS, HIDDEN = 28, 1024
MODES = {"plain": 0, "wait_first": 1, "weights_first": 2}


@triton.jit
def _row_product(
    y_ptr,
    x_ptr,
    res_ptr,
    nw_ptr,
    w_ptr,
    N,
    K,
    eps,
    NORM: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
):
    n, k = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    if MODE > 0:
        gdc_launch_dependents()
    if MODE == 1:
        gdc_wait()
    mask = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=mask, other=0.0)
    if FUSE_SILU:
        up = tl.load(w_ptr + (n + N)[:, None].to(tl.int64) * K + k[None, :], mask=mask, other=0.0)
    if MODE == 2:
        gdc_wait()
    h = tl.load(x_ptr + k, mask=k < K, other=0.0)
    if NORM:
        h = h.to(tl.float32) + tl.load(res_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        h = h * tl.rsqrt(tl.sum(h * h) / K + eps) * tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    x = h.to(tl.float32)[None, :]
    acc = tl.sum(w.to(tl.float32) * x, axis=1)
    if FUSE_SILU:
        acc = acc / (1.0 + tl.exp(-acc)) * tl.sum(up.to(tl.float32) * x, axis=1)
    tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


def row_product(y, x, w, norm: bool, silu: bool, mode: int, nw) -> None:
    n, k = (w.shape[0] // 2 if silu else w.shape[0]), w.shape[1]
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(4 if n >= 4096 else 2, 4096 // block_k))
    _row_product[(triton.cdiv(n, block_n),)](
        y,
        x,
        x,
        nw,
        w,
        n,
        k,
        1e-6,
        NORM=norm,
        FUSE_SILU=silu,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MODE=mode,
        num_warps=4,
        launch_pdl=mode > 0,
    )


def products() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)

    layers = [
        dict(
            qkv=rnd(4096, HIDDEN),
            o=rnd(HIDDEN, 2048),
            gate_up=rnd(6144, HIDDEN),
            down=rnd(HIDDEN, 3072),
            nw=torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    x, x0 = rnd(1, HIDDEN), rnd(1, HIDDEN)
    qkv, attn, hidden, act = (
        torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n in (4096, 2048, HIDDEN, 3072)
    )
    weight_bytes = sum(
        t.numel() * 2 for layer in layers for t in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])
    )

    def step(mode: int) -> None:
        for layer in layers:
            row_product(qkv, x, layer["qkv"], True, False, mode, layer["nw"])
            row_product(hidden, attn, layer["o"], False, False, mode, layer["nw"])
            row_product(act, hidden, layer["gate_up"], True, True, mode, layer["nw"])
            row_product(x, act, layer["down"], False, False, mode, layer["nw"])

    out, bits = {"weight_bytes": weight_bytes, "rounds": [{}, {}]}, {}  # the second round confirms the first
    for times in out["rounds"]:
        for name, mode in MODES.items():
            step(mode)
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(functools.partial(step, mode), rep=200, return_mode="median") * 1e3
            times[name] = {"us_per_step": round(us, 1), "us_per_layer": round(us / LAYERS, 2)}
            print(json.dumps({"products": name, **times[name]}), flush=True)
    for name, mode in MODES.items():
        x.copy_(x0)
        attn.copy_(x0.repeat(1, 2))
        step(mode)
        torch.cuda.synchronize()
        bits[name] = x.clone()
    out["same_bits"] = all(torch.equal(bits["plain"], b) for b in bits.values())
    return out


def decode_step_kernels(
    layers: int = 28, context: int = 1024, block: int = 16, seed: int = 0
) -> Callable[[], torch.Tensor]:
    "A decode step's kernels at batch 1 (the decoder layer's one-row path) over random weights and caches."
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * shape[-1] ** -0.5).bfloat16()

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()

    ws = [
        dict(
            qkv=rnd(4096, 1024),
            o=rnd(1024, 2048),
            gate_up=rnd(6144, 1024),
            down=rnd(1024, 3072),
            n1=norm(1024),
            n2=norm(1024),
            qn=norm(128),
            kn=norm(128),
            kc=rnd(context // block, block, 8, 128),
            vc=rnd(context // block, block, 8, 128),
        )
        for _ in range(layers)
    ]
    cos_sin = torch.randn(context, 128, device="cuda", generator=g)
    pos, slot = torch.tensor([context - 1], device="cuda"), torch.tensor([context - 1], device="cuda")
    tables = torch.arange(context // block, device="cuda", dtype=torch.int32)[None]
    lens, x = torch.tensor([context], device="cuda", dtype=torch.int32), rnd(1, 1024)

    def step() -> torch.Tensor:
        h, res = x, None
        for w in ws:
            qkv, res = norm_gemv(h, res, w["n1"], 1e-6, w["qkv"])
            q = qk_norm_rope_store(qkv, 16, 8, 128, w["qn"], w["kn"], 1e-6, cos_sin, pos, slot, w["kc"], w["vc"])
            h = gemv(paged_decode_attention(q, w["kc"], w["vc"], lens, tables, 128**-0.5).view(1, -1), w["o"])
            act, res = norm_gemv(h, res, w["n2"], 1e-6, w["gate_up"], fuse_silu=True)
            h = gemv(act, w["down"])
        return h + res

    return step


def package() -> dict:
    import minivllm.kernels.common as kernels_common

    step, out, results = decode_step_kernels(), {"rounds": [{}, {}]}, {}
    for times in out["rounds"]:
        for early in (False, True):
            kernels_common.ENABLE_PDL = early
            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = step()
            us = triton.testing.do_bench(graph.replay, rep=200, return_mode="median") * 1e3
            name = "early" if early else "plain"
            times[name] = {"us_per_step": round(us, 1), "us_per_layer": round(us / LAYERS, 2)}
            results[name] = result.clone()
            print(json.dumps({"package": name, **times[name]}), flush=True)
    out["max_abs_difference"] = (results["plain"].float() - results["early"].float()).abs().max().item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results here (JSON)")
    ap.add_argument("--skip-package", action="store_true", help="only the products' probe")
    args = ap.parse_args()
    from minivllm.bench import environment

    report = {"environment": environment(), "products": products()}
    if not args.skip_package:
        report["package"] = package()
    print(json.dumps({k: v for k, v in report.items() if k != "environment"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
