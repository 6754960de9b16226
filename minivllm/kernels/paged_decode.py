from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .cascade import (SHARED_BLOCK_M, SHARED_BLOCK_N, SHARED_NUM_STAGES, SHARED_NUM_WARPS, _shared_prefix_kernel,
                      choose_prefix_splits)
from .common import check_device, check_kv_cache, dot_options, next_pow2, online_softmax_update

# %%
@triton.jit(do_not_specialize=["num_splits", "num_parts", "stride_bt"])
def _paged_decode_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        prefix_len_ptr, qk_scale, num_splits, num_parts, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_k_block, stride_k_tok, stride_k_head, stride_v_block, stride_v_tok, stride_v_head, stride_bt,
        NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_SPLITS: tl.constexpr,
        CASCADE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    kv_head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    kv_start = 0
    if CASCADE:                                 # positions [0, kv_start) are the shared prefix: read elsewhere
        kv_start = tl.load(prefix_len_ptr)
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.maximum(tl.cdiv(context_len, BLOCK_N) - first_tile, 0)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, first_tile + num_tiles)
    rows = tl.arange(0, GROUP_PAD)              # the query heads that share this KV head (padded to >= 16)
    heads, row_mask = kv_head * GROUP + rows, rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    part = (seq * NUM_Q_HEADS + heads) * num_parts + (num_parts - num_splits) + split   # this split's partial slot
    if tile_start >= tile_end:                  # nothing to read: an empty split, or an empty (padding) sequence
        if USE_SPLITS:
            tl.store(part_lse_ptr + part, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=row_mask)
        else:
            tl.store(out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
                     tl.zeros([GROUP_PAD, DIM_PAD], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & dim_mask[None, :])
        return
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i, l_i = tl.full([GROUP_PAD], float("-inf"), tl.float32), tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq * stride_bt
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + offs_n
        valid = (pos >= kv_start) & (pos < context_len)
        block, row = tl.load(block_table + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64), pos % PAGE_SIZE
        k = tl.load(k_cache_ptr + (block * stride_k_block + row * stride_k_tok + kv_head * stride_k_head)[None, :]
                    + dims[:, None], mask=valid[None, :] & dim_mask[:, None], other=0.0)   # K^T: [DIM_PAD, BLOCK_N]
        v = tl.load(v_cache_ptr + (block * stride_v_block + row * stride_v_tok + kv_head * stride_v_head)[:, None]
                    + dims[None, :], mask=valid[:, None] & dim_mask[None, :], other=0.0)
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale   # [GROUP_PAD, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)
    out = acc / l_i[:, None]
    if USE_SPLITS:
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_mask[:, None] & dim_mask[None, :])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_mask)
    else:
        tl.store(out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])

# %%
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, num_splits, stride_o_tok, stride_o_head,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    head, seq = tl.program_id(0), tl.program_id(1)
    splits, dims = tl.arange(0, SPLITS_PAD), tl.arange(0, DIM_PAD)
    base = (seq * NUM_Q_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    has_kv, lse_max = lse > float("-inf"), tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0))   # 0 for empty splits
    o = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                mask=has_kv[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)

# %%
DECODE_BLOCK_N = 64      # KV positions per tile: 4 blocks of 16, or a quarter of a block of 256
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3    # software pipelining: block ids fetched 2 tiles ahead, K/V 1 tile ahead
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


@functools.cache   # a fact of the hardware: the same for every caller
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    "Streaming multiprocessors of a CUDA device (a small fixed number for the CPU interpreter)."
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, sms: int) -> int:
    "Split each sequence's KV so that about 4 programs per SM run, with at least MIN_TILES_PER_SPLIT tiles each."
    wanted = -(-4 * sms // max(batch * num_kv_heads, 1))
    most = max(1, triton.cdiv(triton.cdiv(max_context, block_n), MIN_TILES_PER_SPLIT))
    return max(1, min(wanted, most, MAX_SPLITS))

# %%
@dataclass(frozen=True)
class DecodeLaunch:
    "How a decode step is cut into programs: the grids of its (up to) three kernels and the partial results' slots."
    num_splits: int     # pieces of each sequence's own KV (the decode kernel's third grid axis)
    prefix_parts: int   # pieces of the shared prefix (cascade), 0 without one
    group_pad: int      # query heads per KV head, padded to a power of two
    q_tiles: int        # programs per KV head of the shared-prefix kernel, SHARED_BLOCK_M query rows each

    @property
    def num_parts(self) -> int:
        "Partial results per (sequence, head), merged at the end: the prefix's parts first, then the splits."
        return self.prefix_parts + self.num_splits

    @property
    def use_splits(self) -> bool:
        return self.num_parts > 1


def plan_decode(batch: int, num_heads: int, num_kv_heads: int, max_context: int, sms: int, cascade: bool = False,
                block_n: int = DECODE_BLOCK_N, num_splits: int | None = None) -> DecodeLaunch:
    group_pad = next_pow2(num_heads // num_kv_heads)
    num_splits = choose_num_splits(batch, num_kv_heads, max_context, block_n, sms) if num_splits is None else num_splits
    q_tiles = triton.cdiv(batch, max(SHARED_BLOCK_M, group_pad) // group_pad)
    prefix_parts = choose_prefix_splits(num_kv_heads * q_tiles, sms) if cascade else 0
    return DecodeLaunch(num_splits, prefix_parts, group_pad, q_tiles)

# %%
def _check_decode(q, k_cache, v_cache, context_lens, block_tables, shared_prefix_len) -> None:
    check_kv_cache(k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {tuple(k_cache.shape)}: head_dim must match "
                         f"and the number of query heads must be a multiple of the number of KV heads")
    if context_lens.shape != (batch,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"context_lens {tuple(context_lens.shape)} and block_tables {tuple(block_tables.shape)} "
                         f"must have one row per sequence ({batch})")
    cascade = shared_prefix_len is not None
    if cascade and (shared_prefix_len.shape != (1,) or shared_prefix_len.dtype != torch.int32):
        raise ValueError(f"shared_prefix_len must be an int32 tensor of shape (1,), got {shared_prefix_len.dtype} "
                         f"{tuple(shared_prefix_len.shape)}")
    check_device(q, k_cache, v_cache, context_lens, block_tables, *([shared_prefix_len] if cascade else []))

# %%
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, *, shared_prefix_len: torch.Tensor | None = None,
                           num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    "q [B, heads, dim], a token per sequence, over its cached KV; a `shared_prefix_len` (whole blocks) is read once."
    _check_decode(q, k_cache, v_cache, context_lens, block_tables, shared_prefix_len)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q) if out is None else out
    (batch, num_heads, head_dim), (_, page_size, num_kv_heads, _) = q.shape, k_cache.shape
    if batch == 0:
        return out
    block_n, cascade = block_n or DECODE_BLOCK_N, shared_prefix_len is not None
    plan = plan_decode(batch, num_heads, num_kv_heads, block_tables.shape[1] * page_size, num_sms(q.device),
                       cascade, block_n, num_splits)
    part_out = part_lse = out  # placeholders when unused
    if plan.use_splits:
        part_out = torch.empty(batch, num_heads, plan.num_parts, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, plan.num_parts, dtype=torch.float32, device=q.device)
    common = dict(NUM_Q_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
                  DIM_PAD=max(16, next_pow2(head_dim)), PAGE_SIZE=page_size, **dot_options(k_cache.dtype))
    log2_scale, sk, sv = scale * math.log2(math.e), k_cache.stride(), v_cache.stride()
    if cascade:
        _shared_prefix_kernel[(num_kv_heads, plan.q_tiles, plan.prefix_parts)](
            part_out, part_lse, q, k_cache, v_cache, block_tables, context_lens, shared_prefix_len, log2_scale, batch,
            plan.num_parts, q.stride(0), q.stride(1), *sk[:3], *sv[:3], GROUP_PAD=plan.group_pad,
            BLOCK_M=max(SHARED_BLOCK_M, plan.group_pad), BLOCK_N=SHARED_BLOCK_N, **common,
            num_warps=SHARED_NUM_WARPS, num_stages=SHARED_NUM_STAGES)
    _paged_decode_kernel[(num_kv_heads, batch, plan.num_splits)](
        out, part_out, part_lse, q, k_cache, v_cache, block_tables, context_lens,
        shared_prefix_len if cascade else context_lens, log2_scale, plan.num_splits, plan.num_parts,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *sk[:3], *sv[:3], block_tables.stride(0),
        GROUP_PAD=max(16, plan.group_pad), BLOCK_N=block_n, USE_SPLITS=plan.use_splits, CASCADE=cascade, **common,
        num_warps=num_warps or DECODE_NUM_WARPS, num_stages=num_stages or DECODE_NUM_STAGES)
    if plan.use_splits:
        _merge_splits_kernel[(num_heads, batch)](
            out, part_out, part_lse, plan.num_parts, out.stride(0), out.stride(1), NUM_Q_HEADS=num_heads,
            HEAD_DIM=head_dim, DIM_PAD=next_pow2(head_dim), SPLITS_PAD=next_pow2(plan.num_parts), num_warps=4)
    return out
