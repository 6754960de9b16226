from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from .common import online_softmax_update

CASCADE_MIN_PREFIX = 256     # tokens: a shorter shared prefix is not worth two more kernels per layer
CASCADE_MIN_SAVED = 196608   # tokens of K/V per KV head that the cascade saves reading, (batch - 1) x prefix


def shared_prefix_len(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int) -> int:
    "Leading tokens all sequences hold in the *same* blocks (each keeps its last token); 0 for fewer than two."
    if len(block_tables) < 2 or block_tables.shape[1] == 0 or (block_tables[:, 0] != block_tables[0, 0]).any():
        return 0
    same = (block_tables == block_tables[0]).all(axis=0)
    blocks = len(same) if same.all() else int(same.argmin())
    return min(blocks * block_size, (int(context_lens.min()) - 1) // block_size * block_size)


def use_cascade(batch: int, prefix_len: int) -> bool:
    "Whether reading a shared prefix once (two more kernels per layer) beats every sequence reading it."
    return prefix_len >= CASCADE_MIN_PREFIX and (batch - 1) * prefix_len >= CASCADE_MIN_SAVED


def cascade_prefix_len(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int) -> int:
    "The shared prefix a decode batch should read once (the batch builder's question), or 0 when it would not pay."
    prefix = shared_prefix_len(block_tables, context_lens, block_size)
    return prefix if use_cascade(len(block_tables), prefix) else 0

# %%
SHARED_BLOCK_M = 128         # query rows per program of the shared-prefix kernel: 64 sequences x 2 heads for Qwen3
SHARED_BLOCK_N = 64
SHARED_NUM_WARPS = 4
SHARED_NUM_STAGES = 2
MAX_PREFIX_SPLITS = 16


def choose_prefix_splits(programs: int, sms: int) -> int:
    "Cut the shared prefix into pieces so that its kernel has about one program per SM (at most MAX_PREFIX_SPLITS)."
    return max(1, min(-(-sms // max(programs, 1)), MAX_PREFIX_SPLITS))

# %%
@triton.jit(do_not_specialize=["batch", "num_parts"])
def _shared_prefix_kernel(
        part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        prefix_len_ptr, qk_scale, batch, num_parts, stride_q_tok, stride_q_head,
        stride_k_block, stride_k_tok, stride_k_head, stride_v_block, stride_v_tok, stride_v_head,
        NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    kv_head, q_tile = tl.program_id(0), tl.program_id(1)
    chunk = tl.program_id(2)                    # this program's share of the prefix: partial slot `chunk`
    num_chunks, prefix_len = tl.num_programs(2), tl.load(prefix_len_ptr)
    rows = tl.arange(0, BLOCK_M)                # row = sequence * GROUP_PAD + query head within the group
    seq, g = q_tile * (BLOCK_M // GROUP_PAD) + rows // GROUP_PAD, rows % GROUP_PAD
    heads, real = kv_head * GROUP + g, (seq < batch) & (g < GROUP)
    context_len = tl.load(context_lens_ptr + seq, mask=seq < batch, other=0)
    row_mask = real & (context_len >= prefix_len)   # padding rows of a CUDA graph (length 0) take no part
    part = (seq * NUM_Q_HEADS + heads) * num_parts + chunk
    num_tiles = tl.cdiv(prefix_len, BLOCK_N)
    per_chunk = tl.cdiv(num_tiles, num_chunks)
    tile_start = chunk * per_chunk
    tile_end = tl.minimum(tile_start + per_chunk, num_tiles)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    if tile_start >= tile_end:
        tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=real)
        return
    q = tl.load(q_ptr + seq[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + offs_n
        valid = pos < prefix_len
        block = tl.load(block_tables_ptr + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)  # row 0: shared
        row = pos % PAGE_SIZE
        k = tl.load(k_cache_ptr + (block * stride_k_block + row * stride_k_tok + kv_head * stride_k_head)[None, :]
                    + dims[:, None], mask=valid[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + (block * stride_v_block + row * stride_v_tok + kv_head * stride_v_head)[:, None]
                    + dims[None, :], mask=valid[:, None] & dim_mask[None, :], other=0.0)
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale   # [BLOCK_M, BLOCK_N]: many sequences at once
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None],
             mask=row_mask[:, None] & dim_mask[None, :])
    tl.store(part_lse_ptr + part, tl.where(row_mask, m_i + tl.log2(l_i), float("-inf")), mask=real)
