from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_device, check_kv_cache, next_pow2


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_k_tok, stride_k_head,
                          stride_v_tok, stride_v_head, stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
                          NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                          DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to write
        return
    heads, dims = tl.arange(0, HEADS_PAD)[:, None], tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc_slot + heads * stride_kc_head + dims, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_slot + heads * stride_vc_head + dims, v, mask=mask)

# %%
def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    "Write k, v [N, kv_heads, head_dim] into the caches at `slot_mapping` (negative slots are skipped)."
    check_kv_cache(k_cache, v_cache)
    n, heads, dim = k.shape
    if v.shape != k.shape or tuple(k_cache.shape[2:]) != (heads, dim) or slot_mapping.shape != (n,):
        raise ValueError(f"store_kvcache: k, v {tuple(k.shape)}, {tuple(v.shape)}, slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not fit a cache of {tuple(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"store_kvcache: k/v are {k.dtype}, the cache is {k_cache.dtype}")
    check_device(k, v, k_cache, v_cache, slot_mapping)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if n == 0:
        return
    _store_kvcache_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=heads, HEAD_DIM=dim, HEADS_PAD=next_pow2(heads), DIM_PAD=next_pow2(dim))
