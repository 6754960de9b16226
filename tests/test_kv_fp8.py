"""An 8-bit KV cache (kv_cache_dtype="fp8", notebooks 05, 06 and 09): the store rounds to e4m3 (clamped to +-448), the
Triton kernels (in the interpreter here, on the GPU under -m gpu) read it and agree with the reference run on the
rounded cache; the engine runs with it on the CPU, sizes 4x the blocks of a float32 cache, and its greedy tokens
stay close to the 16-bit cache's on the embedded model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minivllm import LLM, TINY_MODEL_PATH
from minivllm.kernels.paged_decode import paged_decode_attention
from minivllm.kernels.paged_prefill import paged_prefill_attention
from minivllm.kernels.reference import paged_attention_ref, store_kvcache_ref
from minivllm.kernels.store_kvcache import store_kvcache
from minivllm.kernels.torch_attention import paged_attention_torch, store_kvcache_torch
from minivllm.layers.attention import AttentionMetadata

FP8 = torch.float8_e4m3fn
BLOCK, HQ, HKV, D = 4, 4, 2, 16


def step(q_lens, ctx_lens, device="cpu", dtype=torch.float32, seed=0, outlier=False):
    "A cache holding every sequence's K/V (16-bit and 8-bit copies, written by the Triton store), and the queries."
    g = torch.Generator().manual_seed(seed)
    tables, used = [], 0
    for n in ctx_lens:
        tables.append(list(range(used, used + -(-n // BLOCK))))
        used += len(tables[-1])
    perm = torch.randperm(used + 2, generator=g).tolist()  # blocks scattered
    tables = [[perm[b] for b in t] for t in tables]
    full = AttentionMetadata.build(ctx_lens, ctx_lens, tables, BLOCK, device)
    k = torch.randn(sum(ctx_lens), HKV, D, generator=g).to(device, dtype)
    v = torch.randn(sum(ctx_lens), HKV, D, generator=g).to(device, dtype)
    if outlier:
        k[0, 0, 0] = 1000.0  # beyond e4m3's range: clamped to 448
    caches = {}
    for name, cache_dtype in [("16", dtype), ("8", FP8)]:
        kc = torch.zeros(used + 2, BLOCK, HKV, D, dtype=cache_dtype, device=device)
        vc = torch.zeros_like(kc)
        store_kvcache(k, v, kc, vc, full.slot_mapping)
        caches[name] = (kc, vc)
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, BLOCK, device)
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to(device, dtype)
    return q, meta, caches, (k, v, full.slot_mapping)


def test_store_rounds_to_e4m3_and_clamps_like_the_torch_path():
    q, meta, caches, (k, v, slots) = step([1, 1], [9, 5], outlier=True)
    kc8, vc8 = caches["8"]
    ref_k, ref_v = torch.zeros_like(kc8), torch.zeros_like(vc8)
    store_kvcache_ref(k, v, ref_k, ref_v, slots)  # the torch path's rounding
    assert torch.equal(kc8.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc8.view(torch.uint8), ref_v.view(torch.uint8))
    tk, tv = torch.zeros_like(kc8), torch.zeros_like(vc8)
    store_kvcache_torch(k, v, tk, tv, slots)
    assert torch.equal(tk.view(torch.uint8), kc8.view(torch.uint8))
    first = kc8.view(-1, HKV, D)[slots[0]].float()
    assert first[0, 0].item() == 448.0 and not torch.isnan(kc8.float()).any()
    err = (kc8.view(-1, HKV, D)[slots].float() - k.clamp(-448, 448)).abs() / k.abs().clamp(min=2**-6)
    assert err.max().item() <= 2**-4 + 1e-6  # e4m3 keeps 3 mantissa bits: half a step of 2^-3


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_reads_an_8bit_cache(splits):
    q, meta, caches, _ = step([1, 1, 1], [9, 21, 5])
    kc8, vc8 = caches["8"]
    out = paged_decode_attention(
        q, kc8, vc8, meta.context_lens, meta.block_tables, D**-0.5, num_splits=splits, block_n=16
    )
    ref = paged_attention_ref(
        q, kc8.float(), vc8.float(), meta.cu_seqlens_q, meta.context_lens, meta.block_tables, D**-0.5
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    full = paged_attention_ref(
        q, *(c.float() for c in caches["16"]), meta.cu_seqlens_q, meta.context_lens, meta.block_tables, D**-0.5
    )
    assert 0 < (out - full).abs().max().item() < 0.05 * full.abs().max().item()  # the cache's rounding, no more


@pytest.mark.parametrize("splits", [1, 3])
def test_16bit_queries_read_an_8bit_cache_as_float16_tiles(splits):
    "bfloat16 queries: 8-bit tiles become float16 by default (f16_tiles), as close to the reference as bfloat16 ones."
    q, meta, caches, _ = step([1, 1, 1], [9, 21, 5])
    kc8, vc8 = caches["8"]
    q = q.to(torch.bfloat16)
    args = (q, kc8, vc8, meta.context_lens, meta.block_tables, D**-0.5)
    ref = paged_attention_ref(
        q.float(), kc8.float(), vc8.float(), meta.cu_seqlens_q, meta.context_lens, meta.block_tables, D**-0.5
    )
    default = paged_decode_attention(*args, num_splits=splits, block_n=16)
    f16 = paged_decode_attention(*args, num_splits=splits, block_n=16, f16_tiles=True)
    bf16 = paged_decode_attention(*args, num_splits=splits, block_n=16, f16_tiles=False)
    assert torch.equal(default, f16) and default.dtype == torch.bfloat16
    step_of_output = 2**-8 * ref.abs().max().item()  # bfloat16's rounding of the output itself
    assert (f16.float() - ref).abs().max().item() <= step_of_output
    assert (bf16.float() - ref).abs().max().item() <= step_of_output


def test_float16_tiles_in_a_mixed_step_and_under_a_shared_prefix():
    "The decode kernel's two other modes with float16 tiles: a mixed step's one-token row, and cascade's folded prefix."
    q, meta, caches, _ = step([3, 1, 6], [9, 21, 6])
    kc8, vc8 = caches["8"]
    q = q.to(torch.bfloat16)
    args = (meta.context_lens, meta.block_tables, D**-0.5)
    ref = paged_attention_ref(q.float(), kc8.float(), vc8.float(), meta.cu_seqlens_q, *args)
    row = meta.cu_seqlens_q[1].item()  # the one-token sequence's row: the only one the decode kernel writes
    for f16 in (True, False):
        out = torch.zeros_like(q)
        paged_decode_attention(
            q, kc8, vc8, *args, out=out, cu_seqlens_q=meta.cu_seqlens_q, num_splits=2, block_n=16, f16_tiles=f16
        )
        assert (out[row].float() - ref[row]).abs().max().item() <= 2**-7 * ref[
            row
        ].abs().max().item()  # bfloat16's step
    g = torch.Generator().manual_seed(3)  # three sequences whose first 2 blocks are the same blocks: a shared prefix
    kc8, vc8 = (torch.randn(12, BLOCK, HKV, D, generator=g).to(FP8) for _ in range(2))
    tables, lens = [[7, 2, 0, 5], [7, 2, 9], [7, 2, 4, 11, 1]], [14, 11, 18]
    meta = AttentionMetadata.build([1, 1, 1], lens, tables, BLOCK)
    q = torch.randn(3, HQ, D, generator=g).to(torch.bfloat16)
    args = (meta.context_lens, meta.block_tables, D**-0.5)
    ref = paged_attention_ref(q.float(), kc8.float(), vc8.float(), meta.cu_seqlens_q, *args)
    prefix = torch.tensor([2 * BLOCK], dtype=torch.int32)
    for splits in (1, 2):
        out = paged_decode_attention(q, kc8, vc8, *args, shared_prefix_len=prefix, num_splits=splits, block_n=16)
        assert (out.float() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item()


def test_prefill_kernel_and_torch_path_read_an_8bit_cache():
    q, meta, caches, _ = step([3, 1, 6], [9, 21, 6])
    kc8, vc8 = caches["8"]
    ref = paged_attention_ref(
        q, kc8.float(), vc8.float(), meta.cu_seqlens_q, meta.context_lens, meta.block_tables, D**-0.5
    )
    out = paged_prefill_attention(
        q, kc8, vc8, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, D**-0.5, block_m=16, block_n=16
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        paged_attention_torch(q, kc8, vc8, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, D**-0.5),
        ref,
        rtol=1e-5,
        atol=1e-5,
    )


TOOL = Path(__file__).resolve().parents[1] / "tools" / "fp8_agreement.py"


def fp8_agreement(**engine_kwargs) -> tuple[float, float, list[int]]:
    "Greedy tokens of the embedded model with an 8-bit and a 16/32-bit cache: (share equal, mean KL, KV blocks)."
    spec = importlib.util.spec_from_file_location("fp8_agreement", TOOL)  # tools/fp8_agreement.py, as on a GPU
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    dtype = engine_kwargs.pop("dtype", "auto")
    result = tool.agreement(TINY_MODEL_PATH, dtype, "cpu", **engine_kwargs)
    return result["share_same"], result["mean_kl"], result["blocks"]


def test_engine_runs_an_8bit_cache_with_four_times_the_blocks():
    share, kl, blocks = fp8_agreement()
    assert blocks[1] // 4 == blocks[0]  # float32 -> 8 bits: 4x the blocks in the same memory
    assert kl < 0.01, kl  # nats, over the top-20 tokens of each step
    assert share >= 0.5, share  # (both measured and printed in notebook 13)


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3'"):
        LLM(TINY_MODEL_PATH, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="not flash_attn"):
        LLM(TINY_MODEL_PATH, kv_cache_dtype="fp8", attention_backend="flash_attn")


@pytest.mark.gpu
def test_gpu_kernels_read_an_8bit_cache():
    q, meta, caches, _ = step([1, 1, 1], [900, 2100, 50], "cuda", torch.bfloat16)
    kc8, vc8 = caches["8"]
    args = (meta.cu_seqlens_q, meta.context_lens, meta.block_tables, D**-0.5)
    ref = paged_attention_ref(q.float(), kc8.float(), vc8.float(), *args)
    out = paged_decode_attention(q, kc8, vc8, meta.context_lens, meta.block_tables, D**-0.5)
    assert (out.float() - ref).abs().max().item() < 2e-2
    q2, meta2, caches2, _ = step([300, 1, 64], [900, 2100, 64], "cuda", torch.bfloat16)
    out2 = paged_prefill_attention(
        q2, *caches2["8"], meta2.cu_seqlens_q, meta2.context_lens, meta2.block_tables, D**-0.5
    )
    ref2 = paged_attention_ref(
        q2.float(),
        *(c.float() for c in caches2["8"]),
        meta2.cu_seqlens_q,
        meta2.context_lens,
        meta2.block_tables,
        D**-0.5,
    )
    assert (out2.float() - ref2).abs().max().item() < 2e-2
