from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import check_device, check_kv_cache, dot_options, next_pow2, online_softmax_update

# %%
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_prefill_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, kv_start_ptr, context_lens_ptr, block_tables_ptr,
        qk_scale, num_seqs, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_k_block, stride_k_tok, stride_k_head, stride_v_block, stride_v_tok, stride_v_head, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    q_block, kv_head = tl.program_id(0), tl.program_id(1)
    lo, hi = 0, num_seqs                       # binary search: the last sequence whose first block is <= q_block
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q   # this program's first query token in the sequence
    if first >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)               # row = token * GROUP_PAD + query head within the group
    tok, g = first + rows // GROUP_PAD, rows % GROUP_PAD
    heads, row_mask = kv_head * GROUP + g, (tok < q_len) & (g < GROUP)
    q_pos = context_len - q_len + tok          # absolute position of each query row
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_end = tl.minimum(context_len, context_len - q_len + first + BLOCK_Q)  # past the last query position: unseen
    kv_start = tl.load(kv_start_ptr + seq).to(tl.int64)                      # used when not PAGED
    for start in range(0, kv_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < kv_end
        if PAGED:
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            k_rows = block * stride_k_block + (pos % PAGE_SIZE) * stride_k_tok
            v_rows = block * stride_v_block + (pos % PAGE_SIZE) * stride_v_tok
        else:
            k_rows, v_rows = (kv_start + pos) * stride_k_tok, (kv_start + pos) * stride_v_tok
        k = tl.load(k_ptr + (k_rows + kv_head * stride_k_head)[None, :] + dims[:, None],
                    mask=valid[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(v_ptr + (v_rows + kv_head * stride_v_head)[:, None] + dims[None, :],
                    mask=valid[:, None] & dim_mask[None, :], other=0.0)
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])

# %%
PREFILL_BLOCK_M = 64     # query rows per program: BLOCK_Q tokens x group heads
PREFILL_BLOCK_N = 64     # KV positions per tile
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2


def plan_prefill(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                 block_m: int | None = None) -> tuple[int, int, tuple[int, int]]:
    "`(block_m, block_q, grid)`: programs of `block_q` tokens x a KV head's query heads, +1 per sequence (short tiles)."
    group_pad = next_pow2(num_heads // num_kv_heads)
    block_m = max(block_m or PREFILL_BLOCK_M, group_pad, 16)
    block_q = block_m // group_pad
    return block_m, block_q, (num_tokens // block_q + num_seqs, num_kv_heads)


def _launch_prefill(q, k, v, cu_seqlens_q, kv_start, context_lens, block_tables, scale, page_size, paged,
                    block_m, block_n, out):
    (num_tokens, num_heads, head_dim), num_kv_heads = q.shape, k.shape[-2]
    if num_heads % num_kv_heads or k.shape[-1] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit k/v {tuple(k.shape)}: head_dim must match and the number "
                         f"of query heads must be a multiple of the number of KV heads")
    num_seqs = cu_seqlens_q.shape[0] - 1
    check_device(q, k, v, cu_seqlens_q, kv_start, context_lens, block_tables)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_seqs <= 0:
        return out
    block_m, block_q, grid = plan_prefill(num_tokens, num_seqs, num_heads, num_kv_heads, block_m)
    sk, sv = k.stride(), v.stride()
    _paged_prefill_kernel[grid](
        out, q, k, v, cu_seqlens_q, kv_start, context_lens, block_tables, scale * math.log2(math.e), num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), sk[0] if paged else 0, sk[-3], sk[-2],
        sv[0] if paged else 0, sv[-3], sv[-2], block_tables.stride(0) if paged else 0,
        GROUP=num_heads // num_kv_heads, GROUP_PAD=next_pow2(num_heads // num_kv_heads), HEAD_DIM=head_dim,
        DIM_PAD=max(16, next_pow2(head_dim)), PAGE_SIZE=page_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n or PREFILL_BLOCK_N, PAGED=paged,
        **dot_options(k.dtype), num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, *, block_m: int | None = None, block_n: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    "Causal attention of a mixed batch (prefill chunks over cached prefixes, decode tokens) over the paged cache."
    check_kv_cache(k_cache, v_cache)
    if cu_seqlens_q.dim() != 1 or context_lens.shape != (cu_seqlens_q.shape[0] - 1,) or block_tables.dim() != 2:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, context_lens {tuple(context_lens.shape)} and "
                         f"block_tables {tuple(block_tables.shape)} must describe the same batch")
    return _launch_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, context_lens, block_tables, scale,
                           k_cache.shape[1], True, block_m, block_n, out)


def varlen_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, scale: float, *, block_m: int | None = None,
                             block_n: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    "Causal attention over k, v [N_k, kv_heads, dim] given per token (no cache); sequences cut by the cu_seqlens."
    if k.shape != v.shape or k.dim() != 3 or cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} must be alike [N, kv_heads, dim] and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must match cu_seqlens_q {tuple(cu_seqlens_q.shape)}")
    k, v = (k, v) if k.stride(-1) == 1 and v.stride(-1) == 1 else (k.contiguous(), v.contiguous())
    context_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return _launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, context_lens, cu_seqlens_k, scale, 1, False,
                           block_m, block_n, out)
