"""The MLP's gate/up product with its activation in the epilogue, timed on a GPU against cuBLAS plus the package's
activation kernel, in one run.

    python tools/gate_up_silu_bench.py OUT.json            # Qwen3-0.6B's MLP (hidden 1,024, intermediate 3,072)
    python tools/gate_up_silu_bench.py OUT.json --graphs   # decode sizes (8 to 256 rows) as CUDA graph replays
    TRITON_INTERPRET=1 python tools/gate_up_silu_bench.py --check   # the kernel against the unfused path, on the CPU

Why: in the 16,384-token prefill step the activation kernel takes 2.9 ms of 34.3
(figures/52_prefill16k_cap_ab_h100.json): it reads the product's [tokens, 6,144] output back and writes half of it.
A product that applies `silu(gate) * up` to its tiles before storing them writes only [tokens, 3,072] and needs no
second kernel; it pays if its product is not much slower than cuBLAS's. Each program here computes a tile of the
gate and the matching tile of the up half (two accumulators over the same rows of x), rounds both to the model's
dtype as the unfused path does, and stores silu(gate) * up. The outputs are compared with the unfused path's (cuBLAS
rounds its sums in another order, so a few elements may differ by one rounding step).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
import triton
import triton.language as tl
from kernel_variants import graph_rows, grouped_tile, save_results

from minivllm.kernels.backends import INTERPRET

CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 256, 64, 8, 2),
    (16, 64, 128, 4, 4),  # few rows: decode steps
    (16, 32, 256, 4, 3),
    (16, 128, 64, 4, 4),
]
GROUP_M = 8  # programs that share a column block run together (the weight tile stays in L2)


@triton.jit
def _gate_up_silu_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    M,
    K,
    inter,
    stride_x,
    stride_w,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    "out[m, n] = silu(x[m] . w[n]) * (x[m] . w[inter + n]), each product rounded to out's dtype first."
    pm, pn = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(inter, BLOCK_N), GROUP_M)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    g_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]  # gate rows, as [K, N]
    u_ptrs = g_ptrs + inter * stride_w  # the up half: rows inter + n
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):  # (K a multiple of BLOCK_K: checked by the launcher)
        x, wg, wu = tl.load(x_ptrs, mask=rows[:, None] < M, other=0.0), tl.load(g_ptrs), tl.load(u_ptrs)
        if DOT_FP32:  # (Triton's interpreter multiplies bfloat16 wrongly: float32 there, as the package's kernels do)
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g)
        acc_u = tl.dot(x, wu, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)  # as the unfused path sees the product's output
    up = acc_u.to(dtype).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], out.to(dtype), mask=rows[:, None] < M)


@triton.jit
def _gate_up_silu_tma_kernel(
    out_desc,
    x_desc,
    w_desc,
    M,
    K,
    inter,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    "The same product with Hopper's tensor-memory loads (TMA): one descriptor per operand, tiles by coordinates."
    pm, pn = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(inter, BLOCK_N), GROUP_M)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([pm * BLOCK_M, k])
        wg = w_desc.load([pn * BLOCK_N, k])
        wu = w_desc.load([inter + pn * BLOCK_N, k])
        if DOT_FP32:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg.T, acc_g)
        acc_u = tl.dot(x, wu.T, acc_u)
    dtype = out_desc.dtype
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    out_desc.store([pm * BLOCK_M, pn * BLOCK_N], (gate / (1.0 + tl.exp(-gate)) * up).to(dtype))


def gate_up_silu_tma(x: torch.Tensor, w: torch.Tensor, config=CONFIGS[0]) -> torch.Tensor:
    "`gate_up_silu` by tensor descriptors (rows past M are neither read nor written: the descriptor bounds them)."
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages = config
    (m, k), inter = x.shape, w.shape[0] // 2
    if k % bk or inter % bn or w.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} do not fit tiles of {bn} x {bk}")
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    descs = (
        TensorDescriptor.from_tensor(out, [bm, bn]),
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk]),
    )
    grid = (triton.cdiv(m, bm) * (inter // bn),)
    _gate_up_silu_tma_kernel[grid](
        *descs, m, k, inter, bm, bn, bk, GROUP_M, INTERPRET, num_warps=warps, num_stages=stages
    )
    return out


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, config=CONFIGS[0]) -> torch.Tensor:
    "silu(x @ w[:I].T) * (x @ w[I:].T) for x [M, K] and the merged gate/up weight w [2I, K]."
    bm, bn, bk, warps, stages = config
    (m, k), inter = x.shape, w.shape[0] // 2
    if k % bk or inter % bn or w.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} do not fit tiles of {bn} x {bk}")
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * (inter // bn),)
    _gate_up_silu_kernel[grid](
        out,
        x,
        w,
        m,
        k,
        inter,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        bm,
        bn,
        bk,
        GROUP_M,
        INTERPRET,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    "The engine's path: the product (cuBLAS on a GPU), then the activation kernel over its output."
    from minivllm.layers.activation import silu_and_mul

    return silu_and_mul(x @ w.t(), triton_kernel=x.is_cuda)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a.float() - b.float()).abs()
    return dict(max_diff=diff.max().item(), differing=(diff > 0).float().mean().item(), max_out=b.abs().max().item())


def check() -> None:
    "The kernel against float32 products rounded as the unfused path rounds them, on small shapes (CPU or GPU)."
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # (the interpreter rounds to bfloat16 its own way)
    g = torch.Generator().manual_seed(0)
    for m in (1, 37, 128):
        x = (torch.randn(m, 128, generator=g) * 0.5).to(device, dtype)
        w = (torch.randn(256, 128, generator=g) * 0.05).to(device, dtype)
        gate, up = (x.float() @ w.float().t()).to(x.dtype).float().chunk(2, dim=-1)  # the product, rounded
        ref = (torch.nn.functional.silu(gate) * up).to(x.dtype)  # the activation kernel: float32, rounded once
        for fn in (gate_up_silu, gate_up_silu_tma):
            got = fn(x, w, (32, 32, 32, 4, 2))
            print(f"{fn.__name__} M {m}: {json.dumps(compare(got, ref))}")


def in_graphs(out: str | None, hidden: int, inter: int) -> None:
    """Decode sizes as decode steps run them: each candidate over 24 copies of the weight in one CUDA graph (eager
    launches, as the default mode times them, charge the unfused path for its second launch)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(2 * inter, hidden, generator=g, device="cuda") * 0.03).bfloat16() for _ in range(24)]
    results = []
    for m in (8, 32, 256):
        x = torch.randn(m, hidden, generator=g, device="cuda").bfloat16()
        rows = [("cuBLAS + activation", lambda w, x=x: unfused(x, w), None)]
        rows += [("fused", lambda w, x=x, c=c: gate_up_silu(x, w, c), c) for c in CONFIGS if c[0] <= max(m, 64)]
        graph_rows(m, rows, weights, results)
    save_results(out, results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="decode sizes, timed as CUDA graph replays")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    args = ap.parse_args()
    if args.check:
        return check()
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("timing needs a CUDA GPU, without TRITON_INTERPRET (--check runs anywhere)")
    if args.graphs:
        return in_graphs(args.out, args.hidden, args.intermediate)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(2 * args.intermediate, args.hidden, generator=g, device="cuda") * 0.03).bfloat16()
    results = []
    for m in (16384, 2048, 256, 32, 8):
        x = torch.randn(m, args.hidden, generator=g, device="cuda").bfloat16()
        flops = 2.0 * m * args.hidden * 2 * args.intermediate
        ref = unfused(x, w)
        rows = [("cuBLAS + activation", functools.partial(unfused, x, w), None)]
        rows += [("fused", functools.partial(gate_up_silu, x, w, c), c) for c in CONFIGS]
        rows += [("fused TMA", functools.partial(gate_up_silu_tma, x, w, c), c) for c in CONFIGS]
        for label, run, config in rows:
            try:
                agree = compare(run(), ref)
                us = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median") * 1e3
            except Exception as e:  # (shared memory: a configuration that does not fit)
                print(m, label, config, type(e).__name__, str(e)[:200], flush=True)
                continue
            row = dict(tokens=m, label=label, config=config, us=us, tflops=flops / us / 1e6, **agree)
            results.append(row)
            print(json.dumps(row), flush=True)
        save_results(args.out, results)


if __name__ == "__main__":
    main()
