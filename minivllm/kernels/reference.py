from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    "The first `length` tokens of one sequence, from `cache` [num_blocks, block_size, heads, dim] via its block table."
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    "q [nq, heads, dim] are the last nq positions of a sequence with keys/values k, v [nk, kv_heads, dim]."
    nq, nk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(nq, device=q.device) + (nk - nq)  # the query rows are the last nq positions
    future = torch.arange(nk, device=q.device)[None, :] > q_pos[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)

# %%
def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    "Causal attention of each sequence's query rows over its cached K/V (prefill chunks and decode tokens alike)."
    out, cu, lens = torch.zeros_like(q), cu_seqlens_q.tolist(), context_lens.tolist()
    for i, length in enumerate(lens):
        k, v = gather_kv(k_cache, block_tables[i], length), gather_kv(v_cache, block_tables[i], length)
        out[cu[i]:cu[i + 1]] = causal_attention_ref(q[cu[i]:cu[i + 1]], k, v, scale)
    return out


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, scale: float) -> torch.Tensor:
    "Causal attention over K/V given per token (no cache): sequence i is rows cu_seqlens_q[i]:cu_seqlens_q[i+1]."
    out, cq, ck = torch.zeros_like(q), cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        out[cq[i]:cq[i + 1]] = causal_attention_ref(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], scale)
    return out

# %%
def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    "Write k, v [N, kv_heads, dim] into the caches at `slot_mapping` (negative slots are skipped)."
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))
