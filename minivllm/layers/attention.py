from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.torch_attention import (
    paged_attention_torch, paged_decode_torch, store_kvcache_torch, varlen_attention_torch)


@dataclass
class AttentionMetadata:
    "What every attention layer of one step needs to know about the step: where the sequences start, end and live."
    cu_seqlens_q: torch.Tensor        # [B+1] int32: prefix sums of the new (query) tokens per sequence
    cu_seqlens_k: torch.Tensor        # [B+1] int32: prefix sums of the KV lengths (cached + new)
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor | None = None    # [N] int64: cache slot of each new token; < 0: do not write
    context_lens: torch.Tensor | None = None    # [B] int32: KV length of each sequence after this step
    block_tables: torch.Tensor | None = None    # [B, max_blocks] int32: physical blocks, padded with -1
    shared_prefix_len: torch.Tensor | None = None  # [1] int32: a decode batch's shared prefix, read once (06)

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        "The metadata of a step where sequence `i` computes its last `query_lens[i]` of `context_lens[i]` tokens."
        slots = [table[p // block_size] * block_size + p % block_size
                 for q_len, kv_len, table in zip(query_lens, context_lens, block_tables)
                 for p in range(kv_len - q_len, kv_len)]
        width = max((len(t) for t in block_tables), default=0)
        tables = [list(t) + [-1] * (width - len(t)) for t in block_tables]
        int32 = dict(dtype=torch.int32, device=device)
        cumsum = lambda xs: torch.tensor([0] + list(xs), **int32).cumsum(0, dtype=torch.int32)  # noqa: E731
        return cls(cumsum(query_lens), cumsum(context_lens), max(query_lens, default=0), max(context_lens, default=0),
                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   context_lens=torch.tensor(list(context_lens), **int32),
                   block_tables=torch.tensor(tables, **int32).reshape(len(tables), width))

# %%
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str) -> None:
    if backend == "torch":
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping)
    else:
        from minivllm.kernels.store_kvcache import store_kvcache
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, backend: str) -> torch.Tensor:
    "Every query token of the step attends to its sequence's cached K/V (causal)."
    if backend == "torch":
        if meta.is_decode_only:
            return paged_decode_torch(q, k_cache, v_cache, meta.context_lens, meta.block_tables, scale)
        return paged_attention_torch(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                                     scale)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        if meta.is_decode_only:
            return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                           block_table=meta.block_tables, softmax_scale=scale, causal=True).squeeze(1)
        return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                      cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                                      max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                                      block_table=meta.block_tables)
    if meta.is_decode_only:
        from minivllm.kernels.paged_decode import paged_decode_attention
        return paged_decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables, scale,
                                      shared_prefix_len=meta.shared_prefix_len)
    from minivllm.kernels.paged_prefill import paged_prefill_attention
    return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale)

# %%
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None, scale: float,
                     backend: str) -> torch.Tensor:
    "Causal attention over the new tokens only (no cache). Without metadata, all N tokens are one sequence."
    if meta is None:
        n = q.shape[0]
        meta = AttentionMetadata(*[torch.tensor([0, n], dtype=torch.int32, device=q.device)] * 2, n, n)
    cu_q, cu_k = meta.cu_seqlens_q, meta.cu_seqlens_k
    if backend == "torch":
        return varlen_attention_torch(q, k, v, cu_q, cu_k, scale)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=meta.max_seqlen_q,
                                      max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True)
    from minivllm.kernels.paged_prefill import varlen_prefill_attention
    return varlen_prefill_attention(q, k, v, cu_q, cu_k, scale)

# %%
class Attention(nn.Module):
    "Paged causal attention: writes the step's K/V into the cache (the engine sets `k_cache`, `v_cache`), then attends."

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend: str = "torch"):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.backend = float(scale), backend
        self.k_cache = self.v_cache = None

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}, backend={self.backend}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        "q [N, heads, dim], k and v [N, kv_heads, dim] -> [N, heads, dim]."
        if self.k_cache is None:   # no cache yet (a model checked on its own, the warm-up step)
            return varlen_attention(q, k, v, meta, self.scale, self.backend)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.backend)
        return paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.backend)
