"""A decode step's attention with the q/k norms, rotation and K/V write folded into the decode kernel: one kernel
fewer a layer. Chained over 28 layers at batch 1, 8 and 32 against the engine's pair of kernels.

    python tools/rope_decode_probe.py OUT.json                        # on a GPU: chains timed as CUDA graphs
    TRITON_INTERPRET=1 python tools/rope_decode_probe.py x.json --check-only   # on a CPU: fused against the pair

The engine's decode step runs, per layer, `qk_norm_rope_store` (a program per token: the queries normed and rotated
into q, the keys normed and rotated and the values written into the cache) and then the decode kernel, which reads
q. At batch 8 the first is 3.7 us a layer (figures/52_decode_kernels_b8_few_rows_h100.json), mostly waiting: for
its launch, its loads and its stores. Here every decode program computes its own query heads from the packed qkv
row, and the one program that reads the new position (the split that holds the last tile) first writes that
position's K and V into the cache, then waits at a barrier for its own threads, then reads the cache as before.
Arms: `pair` (the engine), `fused`, and both again with small tiles (16 positions, 2 warps, 2 stages, twice the
splits: `tools/variant_tree.py --small-decode-tiles`). The question: how many microseconds a layer does the fused
kernel save, at which batch sizes?
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch
import triton
import triton.language as tl

from minivllm.kernels.common import dot_options, pdl_launch_next, pdl_wait, use_pdl
from minivllm.kernels.decode_plan import DECODE_BLOCK_N, DECODE_NUM_STAGES, DECODE_NUM_WARPS, num_sms, plan_decode
from minivllm.kernels.merge_splits import _merge_splits_kernel
from minivllm.kernels.paged_decode import paged_decode_attention
from minivllm.kernels.paged_decode_kernel import _decode_tiles, _split_tiles
from minivllm.kernels.qk_norm_rope import qk_norm_rope_store

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _norm_rope_heads(row_ptr, heads, rows_mask, w_ptr, angles, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads `heads` (a row each) of a packed qkv row: RMSNorm per head in Hugging Face's order, then the neox
    rotation, as `qk_norm_rope_store` computes them; float32 [rows, HEAD_DIM]. Each element's rotation partner (the
    other half) is loaded a second time rather than moved between threads."""
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    partner = (dims + half) % HEAD_DIM
    mask = rows_mask[:, None] & (dims >= 0)[None, :]
    base = row_ptr + heads[:, None] * HEAD_DIM
    x = tl.load(base + dims[None, :], mask=mask, other=0.0)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0)
    if HAS_NORM:
        f = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(f * f, axis=1) / HEAD_DIM + eps)[:, None]
        x = tl.load(w_ptr + dims)[None, :] * (f * r).to(x.dtype)
        xp = tl.load(w_ptr + partner)[None, :] * (xp.to(tl.float32) * r).to(xp.dtype)
    cos = tl.load(angles + dims % half)[None, :]
    sin = tl.load(angles + half + dims % half)[None, :]
    sign = tl.where(dims < half, -1.0, 1.0)[None, :]
    return x.to(tl.float32) * cos + sign * (xp.to(tl.float32) * sin)


@triton.jit(do_not_specialize=["num_splits"])
def _rope_decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, qkv_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, qk_scale, eps, num_splits,
    stride_qkv, stride_cs, so, sk, sv, stride_bt,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_SPLITS: tl.constexpr,
    HAS_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_launch_next(PDL)
    pdl_wait(PDL)
    kv_head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    tile_start, tile_end = _split_tiles(0, context_len, split, num_splits, BLOCK_N)
    row_ptr = qkv_ptr + seq.to(tl.int64) * stride_qkv
    angles = cos_sin_ptr + tl.load(pos_ptr + seq).to(tl.int64) * stride_cs
    rows = tl.arange(0, GROUP_PAD)
    heads, row_mask = kv_head * GROUP + rows, rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = _norm_rope_heads(row_ptr, heads, row_mask, q_w_ptr, angles, eps, HEAD_DIM, HAS_NORM)
    q = q.to(qkv_ptr.dtype.element_ty)  # rounded where the pair's q is stored
    if DOT_FP32:
        q = q.to(tl.float32)
    last = (context_len - 1) // BLOCK_N
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if (tile_start <= last) & (last < tile_end) & (slot >= 0):  # this program reads the new position: write it first
        one = tl.arange(0, 2)
        one_mask = (one < 1)[:, None] & (dims >= 0)[None, :]
        k = _norm_rope_heads(row_ptr, NUM_Q_HEADS + kv_head + one, one < 1, k_w_ptr, angles, eps, HEAD_DIM, HAS_NORM)
        k_out = k_cache_ptr + slot * sk[1] + kv_head * sk[2] + one[:, None] * 0 + dims[None, :]
        tl.store(k_out, k.to(k_cache_ptr.dtype.element_ty), mask=one_mask)
        values = row_ptr + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + one[:, None] * 0 + dims[None, :]
        v_out = v_cache_ptr + slot * sv[1] + kv_head * sv[2] + one[:, None] * 0 + dims[None, :]
        tl.store(v_out, tl.load(values, mask=one_mask), mask=one_mask)
        tl.debug_barrier()  # the program's own stores, visible to all its threads before the tiles are read
    kv = (k_cache_ptr, v_cache_ptr, sk, sv, kv_head, dims, dims < HEAD_DIM)
    row = (block_tables_ptr + seq * stride_bt, 0, context_len)
    m_i, l_i, acc = _decode_tiles(q, qk_scale, kv, row, (tile_start, tile_end), PAGE_SIZE, BLOCK_N, False, False,
                                  DOT_PRECISION)  # fmt: skip
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    out_mask = row_mask[:, None] & (dims >= 0)[None, :]
    if USE_SPLITS:
        part = (seq * NUM_Q_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_mask)
    else:
        ptrs = out_ptr + (seq * so[0] + heads * so[1])[:, None] + dims[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def rope_decode_attention(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    norms: tuple[torch.Tensor | None, torch.Tensor | None, float],
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The fused kernel (and the merge) of a decode step: q from the packed `qkv` [B, (heads + 2 kv_heads) * dim],
    the new K/V written at `slots`, attention over each sequence's cache; out [B, heads, dim]."""
    num_heads, num_kv_heads, dim = heads
    q_w, k_w, eps = norms
    batch, page = context_lens.shape[0], k_cache.shape[1]
    out = qkv.new_empty(batch, num_heads, dim) if out is None else out
    block_n = block_n or DECODE_BLOCK_N
    plan = plan_decode(batch, num_heads, num_kv_heads, block_tables.shape[1] * page, num_sms(qkv.device), False,
                       block_n, num_splits)  # fmt: skip
    parts = (batch, num_heads, plan.num_splits)
    part_out = torch.empty(*parts, dim, dtype=torch.float32, device=qkv.device) if plan.use_splits else out
    part_lse = torch.empty(parts, dtype=torch.float32, device=qkv.device) if plan.use_splits else out
    pdl = use_pdl(qkv.device, batch)
    _rope_decode_kernel[(num_kv_heads, batch, plan.num_splits)](
        out, part_out, part_lse, qkv, qkv if q_w is None else q_w, qkv if k_w is None else k_w, cos_sin, positions,
        slots, k_cache, v_cache, block_tables, context_lens, scale * math.log2(math.e), eps, plan.num_splits,
        qkv.stride(0), cos_sin.stride(0), out.stride()[:2], k_cache.stride()[:3], v_cache.stride()[:3],
        block_tables.stride(0), NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads,
        GROUP_PAD=max(16, plan.group_pad), HEAD_DIM=dim, PAGE_SIZE=page, BLOCK_N=block_n,
        USE_SPLITS=plan.use_splits, HAS_NORM=q_w is not None, PDL=pdl, **dot_options(qkv.dtype),
        num_warps=num_warps or DECODE_NUM_WARPS, num_stages=num_stages or DECODE_NUM_STAGES,
        **({} if INTERPRET else {"launch_pdl": pdl}),
    )  # fmt: skip
    if plan.use_splits:
        _merge_splits_kernel[(num_heads, batch)](
            out, part_out, part_lse, context_lens, plan.num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_heads, HEAD_DIM=dim, DIM_PAD=dim, SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
            MIXED=False, PDL=pdl, num_warps=4, **({} if INTERPRET else {"launch_pdl": pdl}),
        )  # fmt: skip
    return out


def rope_decode(layer: dict, meta: dict, tiles: dict) -> torch.Tensor:
    "The fused kernel on one of the probe's layers."
    return rope_decode_attention(
        layer["qkv"], (HEADS, KV_HEADS, DIM), (layer["q_w"], layer["k_w"], 1e-6), meta["cos_sin"], meta["positions"],
        meta["slots"], layer["k_cache"], layer["v_cache"], meta["context_lens"], meta["block_tables"], DIM**-0.5,
        out=layer["out"], **tiles,
    )  # fmt: skip


def pair_decode(layer: dict, meta: dict, tiles: dict) -> torch.Tensor:
    "The engine's two kernels: `qk_norm_rope_store`, then `paged_decode_attention` (with its merge)."
    q = qk_norm_rope_store(
        layer["qkv"], HEADS, KV_HEADS, DIM, layer["q_w"], layer["k_w"], 1e-6, meta["cos_sin"], meta["positions"],
        meta["slots"], layer["k_cache"], layer["v_cache"],
    )  # fmt: skip
    return paged_decode_attention(
        q, layer["k_cache"], layer["v_cache"], meta["context_lens"], meta["block_tables"], DIM**-0.5,
        out=layer["out"], **tiles,
    )  # fmt: skip


def small_tiles(batch: int, device: torch.device) -> dict:
    "tools/variant_tree.py --small-decode-tiles: 16 positions, 2 warps, 2 stages, splits for 8 programs an SM."
    pairs, tiles = batch * KV_HEADS, 1024 // 16
    return dict(block_n=16, num_warps=2, num_stages=2, num_splits=max(1, min(8 * num_sms(device) // pairs, tiles // 4)))


def cos_sin_table(positions: int, device) -> torch.Tensor:
    inv = 1.0 / (1000000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


def make_step(batch: int, context: int, layers: int, device, seed: int = 0):
    "Random layers (qkv rows, norm weights, caches) and one decode step's metadata: each sequence at `context`."
    dtype = torch.float16 if INTERPRET else torch.bfloat16  # (the interpreter's bfloat16 is wrong)
    g = torch.Generator().manual_seed(seed)
    per_seq = triton.cdiv(context, PAGE)
    blocks = batch * per_seq + 1
    tables = (torch.randperm(blocks - 1, generator=g)[: batch * per_seq] + 1).view(batch, per_seq).to(torch.int32)
    last = context - 1
    slots = tables[:, last // PAGE].to(torch.int64) * PAGE + last % PAGE
    meta = dict(
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        positions=torch.full((batch,), last, dtype=torch.int64, device=device),
        slots=slots.to(device),
        cos_sin=cos_sin_table(context + 1, device),
    )
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype).to(device)  # noqa: E731
    out = []
    for _ in range(layers):
        out.append(
            dict(
                qkv=rand(batch, (HEADS + 2 * KV_HEADS) * DIM),
                q_w=(1 + rand(DIM, s=0.1).float()).to(dtype),
                k_w=(1 + rand(DIM, s=0.1).float()).to(dtype),
                k_cache=rand(blocks, PAGE, KV_HEADS, DIM),
                v_cache=rand(blocks, PAGE, KV_HEADS, DIM),
                out=torch.empty(batch, HEADS, DIM, dtype=dtype, device=device),
            )
        )
    return meta, out


def check(batch: int, context: int, device, tiles: dict) -> dict:
    "The fused kernel against the pair on one layer: outputs and the written K/V, max abs difference."
    meta, (layer,) = make_step(batch, context, 1, device, seed=batch)
    k0, v0 = layer["k_cache"].clone(), layer["v_cache"].clone()
    ref = pair_decode(layer, meta, tiles).float().clone()
    k_ref, v_ref = layer["k_cache"].clone(), layer["v_cache"].clone()
    layer["k_cache"].copy_(k0)
    layer["v_cache"].copy_(v0)
    got = rope_decode(layer, meta, tiles).float()
    return dict(
        out=(got - ref).abs().max().item(),
        out_scale=ref.abs().max().item(),
        k=(layer["k_cache"].float() - k_ref.float()).abs().max().item(),
        v=(layer["v_cache"].float() - v_ref.float()).abs().max().item(),
        k_written=(k_ref.float() - k0.float()).abs().max().item(),
    )


def time_arms(arms: dict, replays: int, rounds: int) -> dict:
    "Each arm's chain captured as a CUDA graph; rounds of `replays` replays, arms alternating; median us a chain."
    graphs = {}
    for name, fn in arms.items():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[name] = g
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, g in graphs.items():
            g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000 / replays)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args()
    device = torch.device("cpu" if INTERPRET else "cuda")
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {"context": args.context, "layers": args.layers, "checks": {}, "chains_us": {}}
    if not INTERPRET:
        result["gpu"] = torch.cuda.get_device_name()
        result["torch"], result["triton"] = torch.__version__, triton.__version__
    for batch in batches:
        ctx = min(args.context, 40) if INTERPRET else args.context
        result["checks"][batch] = {
            "default": check(batch, ctx, device, {}),
            "small": check(batch, ctx, device, small_tiles(batch, device)),
        }
        print(batch, result["checks"][batch], flush=True)
        if args.check_only:
            continue
        meta, layers = make_step(batch, args.context, args.layers, device)
        small = small_tiles(batch, device)
        chain = lambda fn, tiles: lambda: [fn(layer, meta, tiles) for layer in layers]  # noqa: E731, B023
        arms = {
            "pair": chain(pair_decode, {}),
            "fused": chain(rope_decode, {}),
            "pair_small": chain(pair_decode, small),
            "fused_small": chain(rope_decode, small),
        }
        us = time_arms(arms, args.replays, args.rounds)
        result["chains_us"][batch] = {
            "chain": us,
            "per_layer": {k: v / args.layers for k, v in us.items()},
            "saved_per_layer": {k: (us["pair"] - v) / args.layers for k, v in us.items()},
            "small_splits": small["num_splits"],
        }
        print(batch, json.dumps(result["chains_us"][batch]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
