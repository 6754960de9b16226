from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import gather_kv, store_kvcache_ref

GROUP_KV_BYTES = 4 << 20   # float32 keys of one group of decode sequences: small enough to stay in a CPU's cache


def gather_padded_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    "The first `max_len` positions (whole blocks) of each sequence, one copy: [B, L, kv_heads, head_dim]."
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].clamp(min=0).flatten()   # -1 (no block) reads block 0: masked later
    return cache.index_select(0, blocks).view(num_seqs, num_blocks * block_size, *cache.shape[2:])


def decode_attention_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, max_len: int) -> torch.Tensor:
    "q [B, heads, dim], one token per sequence, over its `context_lens[i] <= max_len` cached tokens -> float32 out."
    (num_seqs, num_heads, head_dim), num_kv_heads = q.shape, k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = gather_padded_kv(k_cache, block_tables, max_len).float()              # [B, L, kv_heads, dim]
    v = gather_padded_kv(v_cache, block_tables, max_len).float()
    q = (q.float() * scale).view(num_seqs, num_kv_heads, group, head_dim)
    scores = q.new_empty(num_kv_heads, num_seqs, group, k.shape[1])
    for h in range(num_kv_heads):   # the group's query rows [B, group, dim] @ this head's keys [B, dim, L] (a view)
        torch.bmm(q[:, h], k[:, :, h].transpose(1, 2), out=scores[h])
    past_end = torch.arange(k.shape[1], device=q.device) >= context_lens[:, None]       # [B, L]
    probs = scores.masked_fill_(past_end[:, None], float("-inf")).softmax(dim=-1)
    v.masked_fill_(past_end[:, :, None, None], 0.0)   # slots never written may hold NaN: 0 * NaN would leak into out
    out = q.new_empty(num_kv_heads, num_seqs, group, head_dim)
    for h in range(num_kv_heads):
        torch.bmm(probs[h], v[:, :, h], out=out[h])
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)

# %%
def decode_groups(sorted_lens: list[int], block_size: int, max_tokens: int) -> list[tuple[int, int]]:
    "Cut ascending lengths into runs [start, end) whose padded size, (end - start) x the longest, is <= max_tokens."
    groups, start, n = [], 0, len(sorted_lens)
    while start < n:
        end = start + 1
        while end < n and (end + 1 - start) * -(-sorted_lens[end] // block_size) * block_size <= max_tokens:
            end += 1
        groups.append((start, end))
        start = end
    return groups


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                       block_tables: torch.Tensor, scale: float, group_bytes: int = GROUP_KV_BYTES) -> torch.Tensor:
    "One query token per sequence over its cached K/V: sorted by length, in cache-sized batched groups."
    out = torch.zeros_like(q)                       # a sequence without context (a padding slot) gets zeros
    lens, order = context_lens.sort()
    lens = lens.tolist()
    first = next((i for i, n in enumerate(lens) if n > 0), len(lens))
    budget = max(1, group_bytes // (4 * k_cache.shape[2] * k_cache.shape[3]))   # float32 tokens per group
    for start, end in decode_groups(lens[first:], k_cache.shape[1], budget):
        rows = order[first + start:first + end]
        out[rows] = decode_attention_padded(q[rows], k_cache, v_cache, context_lens[rows], block_tables[rows], scale,
                                            lens[first + end - 1]).to(q.dtype)
    return out

# %%
def causal_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    "`causal_attention_ref` in one fused call: q [n, heads, dim] are the last n positions of k, v [L, kv_heads, dim]."
    n, length = q.shape[0], k.shape[0]
    mask = None if n == length else torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    return F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                          v.float().transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)[0].transpose(0, 1).to(q.dtype)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    "`paged_attention_ref`, fast on a CPU: the decode rows of all sequences batched, one SDPA call per prefill chunk."
    decode = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]) == 1   # the sequences that compute one token
    if bool(decode.all()):
        return paged_decode_torch(q, k_cache, v_cache, context_lens, block_tables, scale)
    out = torch.zeros_like(q)
    if bool(decode.any()):
        rows = cu_seqlens_q[:-1][decode].long()
        out[rows] = paged_decode_torch(q[rows], k_cache, v_cache, context_lens[decode], block_tables[decode], scale)
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, length in enumerate(lens):
        if cu[i + 1] - cu[i] > 1:
            k, v = gather_kv(k_cache, block_tables[i], length), gather_kv(v_cache, block_tables[i], length)
            out[cu[i]:cu[i + 1]] = causal_attention_sdpa(q[cu[i]:cu[i + 1]], k, v, scale)
    return out


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    "`store_kvcache_ref` without its boolean masks when no slot is negative (always, on a CPU: no padded batches)."
    if slot_mapping.numel() == 0 or int(slot_mapping.min()) < 0:
        return store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping.long(), k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping.long(), v.to(v_cache.dtype))


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, scale: float) -> torch.Tensor:
    "`varlen_attention_ref` (no cache) with one fused SDPA call per sequence."
    out, cq, ck = torch.zeros_like(q), cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        if cq[i + 1] > cq[i]:
            out[cq[i]:cq[i + 1]] = causal_attention_sdpa(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]],
                                                         scale)
    return out
