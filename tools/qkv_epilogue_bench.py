"""The attention's qkv product with the q/k norms, the rotation and the K/V write in its epilogue, timed on a GPU
against cuBLAS plus the package's `qk_norm_rope_store`, in one run.

    python tools/qkv_epilogue_bench.py OUT.json        # Qwen3-0.6B's attention (hidden 1,024, 16 + 8 + 8 heads of 128)
    python tools/qkv_epilogue_bench.py OUT.json --graphs   # decode sizes (8 to 256 rows) as CUDA graph replays
    TRITON_INTERPRET=1 python tools/qkv_epilogue_bench.py --check   # the kernel against the unfused path, on the CPU

Why: in the 16,384-token prefill step `qk_norm_rope_store` takes 2.7 ms of 34.3
(figures/52_prefill16k_cap_ab_h100.json): it reads the product's [tokens, 4,096] output back and writes the queries
and the cache. Here each program computes one head's 128 columns for a block of rows, as two accumulators of 64
columns (the two halves the rotation pairs), rounds them to the model's dtype as the product's output is rounded, and
then does what `qk_norm_rope_store` does with that head: a query head normed, rotated and stored; a key head normed,
rotated and written to the cache at its tokens' slots; a value head written to the cache. The [tokens, 4,096] product
is never stored.
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
from minivllm.kernels.qk_norm_rope import _norm_rotate

CONFIGS = [  # (BLOCK_M, BLOCK_K, num_warps, num_stages); a program's tile is BLOCK_M rows x one head
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 4),
    (128, 128, 8, 2),
    (16, 128, 4, 4),
]
GROUP_M = 8


@triton.jit
def _qkv_epilogue_kernel(
    x_ptr,
    w_ptr,
    q_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    K,
    stride_x,
    stride_w,
    stride_q,
    stride_cs,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    "Rows pm * BLOCK_M.., head `head` of q, k or v: product, then that head's part of `qk_norm_rope_store`."
    pm, head = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), NUM_HEADS + 2 * NUM_KV_HEADS, GROUP_M)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    half = tl.arange(0, HEAD_DIM // 2)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w1_ptrs = w_ptr + (head * HEAD_DIM + half)[None, :].to(tl.int64) * stride_w + ks[:, None]  # [K, D/2]
    w2_ptrs = w1_ptrs + (HEAD_DIM // 2) * stride_w
    acc1 = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    acc2 = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    row_ok = rows < M
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w1 = tl.load(w1_ptrs)
        w2 = tl.load(w2_ptrs)
        if DOT_FP32:
            x, w1, w2 = x.to(tl.float32), w1.to(tl.float32), w2.to(tl.float32)
        acc1 = tl.dot(x, w1, acc1)
        acc2 = tl.dot(x, w2, acc2)
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        w2_ptrs += BLOCK_K
    dtype = q_ptr.dtype.element_ty
    x1 = acc1.to(dtype)  # the product's output, as the unfused path stores it
    x2 = acc2.to(dtype)
    mask = row_ok[:, None] & (half >= 0)[None, :]
    if head < NUM_HEADS + NUM_KV_HEADS:  # a query or key head: norm and rotation
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        angles = cos_sin_ptr + pos[:, None] * stride_cs + half[None, :]
        cos = tl.load(angles, mask=mask, other=1.0)
        sin = tl.load(angles + HEAD_DIM // 2, mask=mask, other=0.0)
        if head < NUM_HEADS:
            y1, y2 = _norm_rotate(x1, x2, q_w_ptr, cos, sin, eps, HEAD_DIM, True)
            out = q_ptr + rows[:, None].to(tl.int64) * stride_q + head * HEAD_DIM + half[None, :]
            tl.store(out, y1.to(dtype), mask=mask)
            tl.store(out + HEAD_DIM // 2, y2.to(dtype), mask=mask)
        else:
            y1, y2 = _norm_rotate(x1, x2, k_w_ptr, cos, sin, eps, HEAD_DIM, True)
            slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
            keep = mask & (slot >= 0)[:, None]
            out = k_cache_ptr + slot[:, None] * stride_kc_slot + (head - NUM_HEADS) * stride_kc_head + half[None, :]
            tl.store(out, y1.to(k_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(out + HEAD_DIM // 2, y2.to(k_cache_ptr.dtype.element_ty), mask=keep)
    else:  # a value head: into the cache as it is
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        keep = mask & (slot >= 0)[:, None]
        vh = head - NUM_HEADS - NUM_KV_HEADS
        out = v_cache_ptr + slot[:, None] * stride_vc_slot + vh * stride_vc_head + half[None, :]
        tl.store(out, x1, mask=keep)
        tl.store(out + HEAD_DIM // 2, x2, mask=keep)


def qkv_epilogue(x, w, heads, q_w, k_w, eps, cos_sin, positions, slots, k_cache, v_cache, config=CONFIGS[0]):
    "The queries [M, heads, D], and the keys and values written into the caches, from rows x and the qkv weight."
    bm, bk, warps, stages = config
    num_heads, num_kv_heads, head_dim = heads
    (m, k), n_heads = x.shape, num_heads + 2 * num_kv_heads
    if k % bk or w.shape != (n_heads * head_dim, k):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} do not fit {heads} heads or tiles of {bk}")
    q = x.new_empty(m, num_heads, head_dim)
    kc, vc = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])  # [slots, kv_heads, D]
    grid = (triton.cdiv(m, bm) * n_heads,)
    _qkv_epilogue_kernel[grid](
        x,
        w,
        q,
        q_w,
        k_w,
        cos_sin,
        positions,
        slots,
        kc,
        vc,
        m,
        k,
        x.stride(0),
        w.stride(0),
        q.stride(0),
        cos_sin.stride(0),
        kc.stride(0),
        kc.stride(1),
        vc.stride(0),
        vc.stride(1),
        eps,
        num_heads,
        num_kv_heads,
        head_dim,
        bm,
        bk,
        GROUP_M,
        INTERPRET,
        num_warps=warps,
        num_stages=stages,
    )
    return q


def unfused(x, w, heads, q_w, k_w, eps, cos_sin, positions, slots, k_cache, v_cache):
    "The engine's path: the product (cuBLAS on a GPU), then `qk_norm_rope_store` over its output."
    from minivllm.kernels.qk_norm_rope import qk_norm_rope_store

    return qk_norm_rope_store(x @ w.t(), *heads, q_w, k_w, eps, cos_sin, positions, slots, k_cache, v_cache)


def problem(m, heads, hidden, device, dtype, block_size=16, seed=0):
    "Rows, weights, norms, the cos/sin table, positions and slots (every token a slot, some -1: padding)."
    from minivllm.layers.rotary_embedding import rope_cos_sin_cache

    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, d = heads
    x = (torch.randn(m, hidden, generator=g) * 0.5).to(device, dtype)
    w = (torch.randn((num_heads + 2 * num_kv_heads) * d, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    q_w, k_w = (1 + 0.1 * torch.randn(2, d, generator=g)).to(device, dtype)
    cos_sin = rope_cos_sin_cache(d, 4096, 1e6).to(device)
    positions = (torch.arange(m) % 1024).to(device)
    slots = torch.randperm(m + block_size, generator=g)[:m].to(device)
    slots[::7] = -1  # padding tokens: no K/V kept
    blocks = (m + block_size) // block_size + 1
    cache = torch.zeros(blocks, block_size, num_kv_heads, d, dtype=dtype, device=device)
    return x, w, heads, q_w, k_w, 1e-6, cos_sin, positions, slots, cache, cache.clone()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a.float() - b.float()).abs()
    return dict(max_diff=diff.max().item(), differing=(diff > 0).float().mean().item(), max_out=b.abs().max().item())


def run_both(args: tuple, fn, config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kc, vc = args[-2].clone(), args[-1].clone()
    q = fn(*args[:-2], kc, vc) if config is None else fn(*args[:-2], kc, vc, config)
    return q, kc, vc


def check() -> None:
    "The kernel against the unfused path, small heads, float16 (the interpreter rounds bfloat16 its own way)."
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for m in (1, 37, 130):
        args = problem(m, (4, 2, 32), 64, device, torch.float16)
        want = run_both(args, unfused)
        got = run_both(args, qkv_epilogue, (32, 32, 4, 2))
        print(f"M {m}: " + " | ".join(f"{n} {json.dumps(compare(a, b))}" for n, a, b in zip("qkv", got, want)))


def in_graphs(out: str | None) -> None:
    "Decode sizes as decode steps run them: each candidate over 24 copies of the qkv weight in one CUDA graph."
    results = []
    for m in (8, 32, 256):
        x, w, *rest = problem(m, (16, 8, 128), 1024, "cuda", torch.bfloat16)
        weights = [w.clone() for _ in range(24)]
        rows = [("cuBLAS + qk_norm_rope_store", lambda w, x=x, rest=rest: unfused(x, w, *rest), None)]
        rows += [("fused", lambda w, x=x, rest=rest, c=c: qkv_epilogue(x, w, *rest, c), c) for c in CONFIGS]
        graph_rows(m, rows, weights, results)
    save_results(out, results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="decode sizes, timed as CUDA graph replays")
    args = ap.parse_args()
    if args.check:
        return check()
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("timing needs a CUDA GPU, without TRITON_INTERPRET (--check runs anywhere)")
    if args.graphs:
        return in_graphs(args.out)

    heads, hidden, results = (16, 8, 128), 1024, []
    for m in (16384, 2048, 256, 32, 8):
        prob = problem(m, heads, hidden, "cuda", torch.bfloat16)
        flops = 2.0 * m * hidden * 32 * 128
        want = run_both(prob, unfused)
        kc, vc = prob[-2].clone(), prob[-1].clone()
        rows = [("cuBLAS + qk_norm_rope_store", functools.partial(unfused, *prob[:-2], kc, vc), None)]
        rows += [("fused", functools.partial(qkv_epilogue, *prob[:-2], kc, vc, config=c), c) for c in CONFIGS]
        for label, run, config in rows:
            try:
                got = run_both(prob, qkv_epilogue, config) if config else want
                agree = {n: compare(a, b) for n, a, b in zip("qkv", got, want)}
                us = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median") * 1e3
            except Exception as e:  # (shared memory: a configuration that does not fit)
                print(m, label, config, type(e).__name__, str(e)[:200], flush=True)
                continue
            row = dict(tokens=m, label=label, config=config, us=us, tflops=flops / us / 1e6, agree=agree)
            results.append(row)
            print(json.dumps(row), flush=True)
        save_results(args.out, results)


if __name__ == "__main__":
    main()
