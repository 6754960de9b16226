"""Triton kernels of notebook 05 against the PyTorch reference.

Without CUDA the kernels run in Triton's interpreter (numpy) on CPU tensors. Triton reads TRITON_INTERPRET when a
kernel is *defined*, so it is set below before `minivllm.kernels.*` is imported (pytest imports every test module
before running any test, and the package imports its kernel modules only when a Triton backend is used). With CUDA,
the same small-shape tests run the compiled kernels on CUDA tensors. Small shapes use float32 (errors ~1e-7,
tolerance 2e-5) plus float16 and bfloat16 cases.
GPU tests (`python -m pytest tests/test_kernels.py -m gpu`) use Qwen3-0.6B's shapes (16 query heads, 8 KV heads,
head_dim 128) in bfloat16, block sizes 16 and 256, contexts up to 8k, batch up to 256: tolerance 2e-2 absolute +
2e-2 relative (bfloat16 keeps 8 significant bits: one rounding of a value near 1 is up to 4e-3, and the kernels round
the softmax weights and the output to bfloat16).
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import numpy as np
import torch

if not torch.cuda.is_available():  # Triton decides when a kernel is defined: before minivllm.kernels is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minivllm.kernels import common  # noqa: E402
from minivllm.kernels.activation import silu_mul  # noqa: E402
from minivllm.kernels.bench import bench_copy, bench_decode  # noqa: E402
from minivllm.kernels.cascade import (
    CASCADE_MIN_PREFIX,
    MAX_PREFIX_SPLITS,
    SHARED_BLOCK_M,  # noqa: E402
    cascade_prefix_len,
    choose_prefix_splits,
    shared_prefix_len,
    use_cascade,
)
from minivllm.kernels.gemv import gemv, norm_gemv  # noqa: E402
from minivllm.kernels.paged_decode import (
    MAX_SPLITS,
    choose_num_splits,  # noqa: E402
    paged_decode_attention,
    plan_decode,
)
from minivllm.kernels.paged_prefill import (
    PREFILL_BLOCK_M,
    paged_prefill_attention,
    plan_prefill,  # noqa: E402
    varlen_prefill_attention,
)
from minivllm.kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from minivllm.kernels.reference import paged_attention_ref, store_kvcache_ref, varlen_attention_ref  # noqa: E402
from minivllm.kernels.rope_decode import rope_decode_attention  # noqa: E402
from minivllm.kernels.store_kvcache import store_kvcache  # noqa: E402
from minivllm.layers.attention import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def random_step(
    q_lens, ctx_lens, block_size, heads=4, kv_heads=2, dim=8, dtype=torch.float32, device=DEVICE, seed=0, spare_blocks=3
):
    "A cache of shuffled blocks holding every sequence's K/V (random), the step's context, and its queries."
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=g).to(device, dtype)
    v_cache = torch.randn(shape, generator=g).to(device, dtype)
    ctx = AttentionMetadata.build(q_lens, ctx_lens, tables, block_size, device=device)
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(device, dtype)
    return q, k_cache, v_cache, ctx


def ref(q, k_cache, v_cache, ctx, scale):
    return paged_attention_ref(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, scale)


# ---------------------------------------------------------------- store_kvcache


@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kvcache_matches_reference_and_skips_negative_slots(block_size):
    g = torch.Generator().manual_seed(1)
    num_blocks, heads, dim, n = 5, 2, 8, 9
    qkv = torch.randn(n, 3 * heads, dim, generator=g).to(DEVICE)  # k and v as strided slices of a packed projection
    k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(DEVICE)
    slots[[2, 7]] = -1
    caches = [torch.randn(num_blocks, block_size, heads, dim, generator=g).to(DEVICE) for _ in range(2)]
    want = [c.clone() for c in caches]
    store_kvcache_ref(k, v, want[0], want[1], slots)
    store_kvcache(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    flat_k = caches[0].view(-1, heads, dim)
    for i in range(n):
        if slots[i] >= 0:
            assert torch.equal(flat_k[slots[i]], k[i])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.equal(
        caches[1].view(-1, heads, dim)[untouched.to(DEVICE)], want[1].view(-1, heads, dim)[untouched.to(DEVICE)]
    )


def test_kernels_reject_cpu_tensors_when_compiled(monkeypatch):
    "TRITON_INTERPRET is read once, at import (kernels.common.INTERPRET): the test sets that flag, not the variable."
    monkeypatch.setattr(common, "INTERPRET", False)
    k, cache = torch.zeros(3, 2, 8), torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        store_kvcache(k, k, cache, cache, torch.zeros(3, dtype=torch.long))


def test_store_kvcache_rejects_mismatches():
    k = torch.zeros(3, 2, 8, device=DEVICE)
    cache = torch.zeros(4, 4, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cache is"):
        store_kvcache(k, k, cache.half(), cache.half(), torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(k, k, cache, cache, torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        store_kvcache(k, k, cache, torch.zeros(4, 4, 2, 16, device=DEVICE), torch.zeros(3, device=DEVICE))


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(block_size, group, num_splits):
    # lengths: one token, not a multiple of the tile, exactly a tile, several tiles (some splits empty with 3 splits)
    ctx_lens = [1, 23, 32, 70]
    q, kc, vc, ctx = random_step([1] * 4, ctx_lens, block_size, heads=2 * group, kv_heads=2, seed=block_size + group)
    out = paged_decode_attention(q, kc, vc, ctx.context_lens, ctx.block_tables, 0.3, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, ref(q, kc, vc, ctx, 0.3), **CPU_TOL)


def test_decode_tile_larger_and_smaller_than_a_block_and_odd_head_dim():
    q, kc, vc, ctx = random_step([1, 1], [37, 64], 16, heads=6, kv_heads=3, dim=24, seed=3)
    want = ref(q, kc, vc, ctx, 0.2)
    for block_n in (16, 32):  # one block per tile, two blocks per tile
        out = paged_decode_attention(q, kc, vc, ctx.context_lens, ctx.block_tables, 0.2, num_splits=2, block_n=block_n)
        torch.testing.assert_close(out, want, **CPU_TOL)


def test_decode_padding_sequence_of_length_zero_gives_zeros():
    "CUDA-graph padding: a slot with context_len 0 reads nothing and returns zeros, with or without splits."
    q, kc, vc, ctx = random_step([1, 1], [9, 5], 4, seed=4)
    context_lens = ctx.context_lens.clone()
    context_lens[1] = 0
    for splits in (1, 2):
        out = paged_decode_attention(q, kc, vc, context_lens, ctx.block_tables, 0.5, num_splits=splits, block_n=16)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[:1], ref(q, kc, vc, ctx, 0.5)[:1], **CPU_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype):
    q, kc, vc, ctx = random_step([1] * 3, [5, 40, 17], 16, heads=4, kv_heads=2, dim=16, dtype=dtype, seed=5)
    out = paged_decode_attention(q, kc, vc, ctx.context_lens, ctx.block_tables, 0.25, num_splits=2, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref(q, kc, vc, ctx, 0.25).float(), **BF16_TOL)


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 1024, 64, 132) == 1  # 2048 programs already fill an H200
    assert choose_num_splits(1, 8, 8192, 64, 132) == 32  # 8 programs -> 256
    assert choose_num_splits(1, 8, 512, 64, 132) == 4  # 2 tiles a split where 4 would leave SMs without a program
    assert choose_num_splits(1, 8, 4096, 64, 132) == 32  # one stream at the bench's capacity: 8 programs -> 256
    assert choose_num_splits(8, 8, 4096, 64, 132) == 8  # 64 pairs of 4-tile splits fill the SMs: 4 tiles a split
    assert choose_num_splits(1, 1, 10**6, 64, 132) == MAX_SPLITS
    assert choose_num_splits(4, 8, 16, 64, 132) == 1
    # at most 4 programs per SM, rounded down: the fastest counts of notebook 06's sweep (CUDA graphs, H200)
    assert [choose_num_splits(b, 8, c, 64, 132) for b, c in [(16, 4096), (32, 4096), (64, 4096), (32, 1024)]] == [
        4,
        2,
        1,
        2,
    ]


def test_decode_rejects_mismatched_shapes():
    q, kc, vc, ctx = random_step([1, 1], [5, 6], 4)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :4], kc, vc, ctx.context_lens, ctx.block_tables, 0.5)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode_attention(q, kc, vc, ctx.context_lens[:1], ctx.block_tables, 0.5)


# ---------------------------------------------------------------- prefill / mixed steps

MIXED = dict(q_lens=[1, 5, 13, 1, 20], ctx_lens=[9, 9, 30, 1, 20])  # decode, chunk over a cached prefix, fresh prompt


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_step_matches_reference(block_size, group):
    q, kc, vc, ctx = random_step(
        MIXED["q_lens"], MIXED["ctx_lens"], block_size, heads=2 * group, kv_heads=2, seed=10 * block_size + group
    )
    out = paged_prefill_attention(q, kc, vc, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, 0.3, block_n=16)
    torch.testing.assert_close(out, ref(q, kc, vc, ctx, 0.3), **CPU_TOL)


def test_mixed_step_small_query_blocks_and_odd_group():
    "Query blocks of 4 tokens (many programs per sequence), a group of 3 padded to 4, head_dim 24 padded to 32."
    q, kc, vc, ctx = random_step(MIXED["q_lens"], MIXED["ctx_lens"], 4, heads=6, kv_heads=2, dim=24, seed=7)
    out = paged_prefill_attention(
        q, kc, vc, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, 0.2, block_m=16, block_n=32
    )
    torch.testing.assert_close(out, ref(q, kc, vc, ctx, 0.2), **CPU_TOL)


def test_mixed_step_bfloat16():
    q, kc, vc, ctx = random_step([3, 1, 17], [3, 30, 40], 16, heads=4, kv_heads=2, dim=16, dtype=torch.bfloat16)
    out = paged_prefill_attention(q, kc, vc, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, 0.25)
    torch.testing.assert_close(out.float(), ref(q, kc, vc, ctx, 0.25).float(), **BF16_TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 2])
def test_mixed_step_split_between_the_prefill_and_decode_kernels(num_splits, group):
    "The prefill kernel leaves the one-token sequences unwritten, the decode kernel writes only them: the reference."
    q, kc, vc, ctx = random_step(MIXED["q_lens"], MIXED["ctx_lens"], 4, heads=2 * group, kv_heads=2, seed=5 + group)
    cu, want = ctx.cu_seqlens_q, ref(q, kc, vc, ctx, 0.3)
    single = torch.tensor([n == 1 for n in MIXED["q_lens"]])
    one_token_rows = cu[:-1][single].long()
    others = torch.ones(len(q), dtype=torch.bool)
    others[one_token_rows] = False
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kc, vc, cu, ctx.context_lens, ctx.block_tables, 0.3, out=out, skip_single=True)
    assert torch.isnan(out[one_token_rows]).all()
    torch.testing.assert_close(out[others], want[others], **CPU_TOL)
    written = paged_decode_attention(
        q, kc, vc, ctx.context_lens, ctx.block_tables, 0.3, out=out, cu_seqlens_q=cu, num_splits=num_splits
    )
    assert written is out
    torch.testing.assert_close(out, want, **CPU_TOL)


def test_a_mixed_steps_merge_is_one_compiled_variant_whatever_its_split_count(monkeypatch):
    "SPLITS_PAD is a compile-time constant: a value not met before compiles a kernel, mid-run for an eager mixed step."
    from minivllm.kernels import paged_decode

    seen, kernel = [], paged_decode._merge_splits_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["SPLITS_PAD"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(paged_decode, "_merge_splits_kernel", Recorder())
    q, kc, vc, ctx = random_step(MIXED["q_lens"], MIXED["ctx_lens"], 4, heads=2, kv_heads=2, seed=5)
    want = ref(q, kc, vc, ctx, 0.3)
    single = ctx.cu_seqlens_q[:-1][torch.tensor([n == 1 for n in MIXED["q_lens"]])].long()
    for splits in (2, 3, 5):
        out = paged_decode_attention(
            q, kc, vc, ctx.context_lens, ctx.block_tables, 0.3, cu_seqlens_q=ctx.cu_seqlens_q, num_splits=splits
        )
        torch.testing.assert_close(out[single], want[single], **CPU_TOL)
    assert len(seen) == 3 and set(seen) == {common.next_pow2(paged_decode.MAX_SPLITS)}, seen


def test_mixed_decode_rejects_a_shared_prefix_and_bad_prefix_sums():
    q, kc, vc, ctx = random_step(MIXED["q_lens"], MIXED["ctx_lens"], 4, heads=2, kv_heads=2)
    prefix = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="no shared prefix"):
        paged_decode_attention(
            q, kc, vc, ctx.context_lens, ctx.block_tables, 0.3, cu_seqlens_q=ctx.cu_seqlens_q, shared_prefix_len=prefix
        )
    with pytest.raises(ValueError, match="must be 1-D"):
        paged_decode_attention(q, kc, vc, ctx.context_lens, ctx.block_tables, 0.3, cu_seqlens_q=ctx.cu_seqlens_q[None])


@pytest.mark.parametrize("group", [1, 2, 4])
def test_varlen_without_cache_matches_reference(group):
    g = torch.Generator().manual_seed(group)
    lens = [7, 1, 19]
    cu = torch.tensor([0, 7, 8, 27], dtype=torch.int32, device=DEVICE)
    q = torch.randn(27, 2 * group, 8, generator=g).to(DEVICE)
    kv = torch.randn(27, 4, 8, generator=g).to(DEVICE)
    k, v = kv[:, :2], kv[:, 2:]  # strided views
    out = varlen_prefill_attention(q, k, v, cu, cu, 0.4, block_n=16)
    assert sum(lens) == q.shape[0]
    torch.testing.assert_close(out, varlen_attention_ref(q, k, v, cu, cu, 0.4), **CPU_TOL)


def test_prefill_rejects_inconsistent_metadata():
    q, kc, vc, ctx = random_step([2, 3], [4, 5], 4)
    with pytest.raises(ValueError, match="same batch"):
        paged_prefill_attention(q, kc, vc, ctx.cu_seqlens_q, ctx.context_lens[:1], ctx.block_tables, 0.5)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        varlen_prefill_attention(q, q[:, :2], q[:, :2], ctx.cu_seqlens_q, ctx.cu_seqlens_q[:2], 0.5)


def test_benchmarks_need_cuda():
    with pytest.raises(ValueError, match="need a CUDA device"):
        bench_decode(batch=2, context=16, device="cpu")
    with pytest.raises(ValueError, match="need a CUDA device"):
        bench_copy(1 << 20, device="cpu")


# ---------------------------------------------------------------- launch planning (pure functions)


def test_plan_decode_worked_examples():
    # Qwen3-0.6B on an H200 (132 SMs), 256 sequences of up to 1024 tokens: 256 x 8 = 2048 programs already fill the
    # card (4 x 132 = 528 wanted), so no split; 16 / 8 = 2 query heads per KV head (a power of two already); a tile
    # of the shared-prefix kernel holds 128 rows = 64 sequences x 2 heads, so 256 sequences need 4 tiles.
    plain = plan_decode(256, 16, 8, 1024, 132)
    assert (plain.num_splits, plain.prefix_parts, plain.group_pad, plain.q_tiles) == (1, 0, 2, 4)
    assert plain.num_parts == 1 and not plain.use_splits  # one part: written straight to out
    # cascade: the prefix kernel has 8 KV heads x 4 tiles = 32 programs; ceil(132 / 32) = 5 pieces of the prefix
    # fill the SMs; the own part is not split, so the decode kernel folds the 5 prefix parts in itself: no merge
    cascade = plan_decode(256, 16, 8, 1024, 132, cascade=True)
    assert (cascade.num_splits, cascade.prefix_parts, cascade.q_tiles) == (1, 5, 4)
    assert cascade.num_parts == 6 and cascade.fold_prefix and not cascade.use_splits
    # one sequence of 8192: 8 programs want ceil(528 / 8) = 66 splits, but 8192 / 64 = 128 tiles allow only 32 splits
    # of 4 tiles; the prefix kernel's 8 x 1 programs want ceil(132 / 8) = 17 pieces, capped at 16
    long = plan_decode(1, 16, 8, 8192, 132, cascade=True)
    assert (long.num_splits, long.prefix_parts, long.q_tiles) == (32, MAX_PREFIX_SPLITS, 1) and MAX_PREFIX_SPLITS == 16
    assert long.num_parts == 48 and long.use_splits and not long.fold_prefix  # 32 splits: the merge kernel
    forced = plan_decode(1, 16, 8, 8192, 132, num_splits=1)  # a caller's num_splits wins (CUDA graphs)
    assert (forced.num_splits, forced.prefix_parts, forced.num_parts, forced.use_splits) == (1, 0, 1, False)
    forced3 = plan_decode(1, 16, 8, 64, 132, num_splits=3)
    assert forced3.num_splits == 3 and forced3.num_parts == 3 and forced3.use_splits


def test_plan_decode_pads_odd_groups_and_tiles_large_ones():
    # 6 / 2 = 3 heads per KV head, padded to 4: a 128-row tile holds 32 sequences, 5 fit in one tile. 2 KV heads x 5
    # sequences = 10 programs on 4 SMs want ceil(16 / 10) = 2 splits, but 100 positions are 2 tiles of 64: one split.
    odd = plan_decode(5, 6, 2, 100, 4)
    assert (odd.group_pad, odd.q_tiles, odd.num_splits, odd.prefix_parts) == (4, 1, 1, 0)
    assert plan_decode(1, 5, 1, 16, 4).group_pad == 8  # 5 -> 8
    assert plan_decode(1, 8, 8, 16, 4).group_pad == 1  # multi-head attention: no padding
    # 256 query heads per KV head: the tile grows to 256 rows (one sequence), so 3 sequences need 3 tiles
    wide = plan_decode(3, 256, 1, 64, 4, cascade=True)
    assert (wide.group_pad, wide.q_tiles) == (256, 3)
    assert wide.prefix_parts == 2  # 1 KV head x 3 tiles on 4 SMs: ceil(4 / 3)
    # 65 sequences of a group of 2 need a second 64-sequence tile
    assert plan_decode(65, 16, 8, 64, 132).q_tiles == 2 and plan_decode(64, 16, 8, 64, 132).q_tiles == 1


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 600),
    num_kv_heads=st.sampled_from([1, 2, 4, 8]),
    group=st.integers(1, 20),
    max_context=st.integers(1, 40000),
    sms=st.sampled_from([1, 4, 16, 132]),
    cascade=st.booleans(),
    block_n=st.sampled_from([16, 32, 64]),
    num_splits=st.sampled_from([None, 1, 2, 7]),
)
def test_plan_decode_invariants(batch, num_kv_heads, group, max_context, sms, cascade, block_n, num_splits):
    num_heads = group * num_kv_heads
    plan = plan_decode(batch, num_heads, num_kv_heads, max_context, sms, cascade, block_n, num_splits)
    # the split count: the caller's, else choose_num_splits' for this batch (at least one, at most MAX_SPLITS)
    if num_splits is None:
        assert plan.num_splits == choose_num_splits(batch, num_kv_heads, max_context, block_n, sms)
        assert 1 <= plan.num_splits <= MAX_SPLITS
        tiles = math.ceil(max_context / block_n)
        # MIN_TILES_PER_SPLIT: no more than tiles / 4, or tiles / 2 where splits of 4 leave SMs without a program
        min_tiles = 4 if batch * num_kv_heads * math.ceil(tiles / 4) >= sms else 2
        assert plan.num_splits <= max(1, math.ceil(tiles / min_tiles))
    else:
        assert plan.num_splits == num_splits
    # the group, padded to the next power of two
    assert plan.group_pad & (plan.group_pad - 1) == 0 and group <= plan.group_pad < 2 * group
    # the shared-prefix kernel's tiles of max(SHARED_BLOCK_M, group_pad) rows cover every sequence, none to spare
    per_tile = max(SHARED_BLOCK_M, plan.group_pad) // plan.group_pad
    assert per_tile >= 1 and (plan.q_tiles - 1) * per_tile < batch <= plan.q_tiles * per_tile
    # cascade adds the prefix's parts (about one program per SM, at most MAX_PREFIX_SPLITS); without it, none
    if cascade:
        programs = num_kv_heads * plan.q_tiles
        assert plan.prefix_parts == choose_prefix_splits(programs, sms)
        assert plan.prefix_parts == min(max(1, math.ceil(sms / programs)), MAX_PREFIX_SPLITS)
    else:
        assert plan.prefix_parts == 0
    assert plan.num_parts == plan.prefix_parts + plan.num_splits
    assert plan.fold_prefix == (cascade and plan.num_splits == 1)  # an unsplit own part folds the prefix in
    assert plan.use_splits == (plan.num_parts > 1 and not plan.fold_prefix)
    assert plan.use_splits or plan.fold_prefix or plan.num_parts == 1  # every part is merged or folded


def test_plan_prefill_worked_examples():
    # Qwen3: group 2, 128 rows = 64 tokens x 2 heads; 100 tokens in 3 sequences: 100 // 64 = 1, plus up to one short
    # tile per sequence = 4 programs along axis 0, one per KV head along axis 1
    assert PREFILL_BLOCK_M == 128
    assert plan_prefill(100, 3, 16, 8) == (128, 64, (4, 8))
    assert plan_prefill(100, 3, 16, 8, block_m=64) == (64, 32, (6, 8))
    # group 3 padded to 4; a requested block_m of 8 is raised to 16 (tl.dot's minimum): 4 tokens per program
    assert plan_prefill(10, 2, 6, 2, block_m=8) == (16, 4, (10 // 4 + 2, 2))
    # 64 query heads per KV head: block_m grows to the group, one token per program, one program per token (+1)
    assert plan_prefill(5, 1, 64, 1, block_m=16) == (64, 1, (5 + 1, 1))
    # multi-head, 7 decode tokens: block_q 128 > 7, so each sequence gets exactly its own program
    assert plan_prefill(7, 7, 4, 4) == (128, 128, (7, 4))
    assert plan_prefill(300, 1, 2, 1, block_m=128) == (128, 64, (300 // 64 + 1, 1))


def programs_of_sequences(lens, block_q, num_programs):
    """What each program along axis 0 of `_paged_prefill_kernel` computes: its sequence is the last one whose first
    program, cu[i] // block_q + i, is <= the program's index; it takes block_q tokens from `first`."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    starts = [cu[i] // block_q + i for i in range(len(lens))]
    covered = []
    for p in range(num_programs):
        seq = max(i for i, start in enumerate(starts) if start <= p)
        first = (p - starts[seq]) * block_q
        covered += [(seq, t) for t in range(first, min(first + block_q, lens[seq]))]
    return covered


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    num_kv_heads=st.sampled_from([1, 2, 8]),
    group=st.integers(1, 40),
    block_m=st.sampled_from([None, 8, 16, 32, 64, 128]),
)
def test_plan_prefill_grid_covers_every_token(lens, num_kv_heads, group, block_m):
    block, block_q, grid = plan_prefill(sum(lens), len(lens), group * num_kv_heads, num_kv_heads, block_m)
    group_pad = 1 << (group - 1).bit_length()
    assert block >= 16 and block >= group and block >= (block_m or PREFILL_BLOCK_M)
    assert block == max(block_m or PREFILL_BLOCK_M, group_pad, 16)  # all powers of two: the smallest that fits
    assert block_q * group_pad == block and block_q >= 1
    assert grid == (sum(lens) // block_q + len(lens), num_kv_heads)
    covered = programs_of_sequences(lens, block_q, grid[0])
    assert sorted(covered) == [(i, t) for i, n in enumerate(lens) for t in range(n)]  # every token, exactly once


# -------------------------------------------------------------- GPU, real sizes (Qwen3-0.6B: 16 heads, 8 KV heads, 128)

QWEN = dict(heads=16, kv_heads=8, dim=128, dtype=torch.bfloat16, device="cuda")
SCALE = 128**-0.5


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_decode_batch_256(block_size):
    g = torch.Generator().manual_seed(0)
    ctx_lens = torch.randint(1, 2049, (256,), generator=g).tolist()
    q, kc, vc, ctx = random_step([1] * 256, ctx_lens, block_size, seed=1, **QWEN)
    want = ref(q, kc, vc, ctx, SCALE).float()
    for splits in (1, None, 4):
        out = paged_decode_attention(q, kc, vc, ctx.context_lens, ctx.block_tables, SCALE, num_splits=splits)
        torch.testing.assert_close(out.float(), want, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_decode_long_contexts_split_kv(block_size):
    ctx_lens = [8192, 8000, 4097, 1, 3000, 7777, 64, 8191]
    q, kc, vc, ctx = random_step([1] * 8, ctx_lens, block_size, seed=2, **QWEN)
    want = ref(q, kc, vc, ctx, SCALE).float()
    for splits in (None, 1, 64):
        out = paged_decode_attention(q, kc, vc, ctx.context_lens, ctx.block_tables, SCALE, num_splits=splits)
        torch.testing.assert_close(out.float(), want, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_mixed_step(block_size):
    # decode tokens, chunks over long cached prefixes, a fresh 2048-token prompt
    q_lens = [1] * 32 + [512, 1000, 2048, 7, 300]
    ctx_lens = [int(x) for x in torch.randint(1, 8193, (32,), generator=torch.Generator().manual_seed(3))] + [
        8192,
        4000,
        2048,
        700,
        300,
    ]
    q, kc, vc, ctx = random_step(q_lens, ctx_lens, block_size, seed=4, **QWEN)
    out = paged_prefill_attention(q, kc, vc, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, SCALE)
    torch.testing.assert_close(out.float(), ref(q, kc, vc, ctx, SCALE).float(), **BF16_TOL)


@pytest.mark.gpu
def test_gpu_varlen_without_cache():
    lens = [1, 2048, 333, 4096]
    cu = torch.tensor([0] + lens, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens), 16, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(sum(lens), 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    out = varlen_prefill_attention(q, k, v, cu, cu, SCALE)
    torch.testing.assert_close(out.float(), varlen_attention_ref(q, k, v, cu, cu, SCALE).float(), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store_kvcache(block_size):
    g = torch.Generator().manual_seed(6)
    num_blocks, n = 4096 // block_size * 8, 3000
    k, v = (torch.randn(n, 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to("cuda")
    slots[::7] = -1
    caches = [torch.randn(num_blocks, block_size, 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2)]
    want = [c.clone() for c in caches]
    store_kvcache_ref(k, v, want[0], want[1], slots)
    store_kvcache(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replays_with_new_lengths():
    "The grid depends only on shapes: capture once, then change lengths and tables in place, and replay."
    q, kc, vc, ctx = random_step([1] * 16, [100] * 16, 16, seed=7, spare_blocks=2000, **QWEN)
    block_tables = torch.full((16, 128), -1, dtype=torch.int32, device="cuda")  # capacity 128 blocks = 2048 tokens
    block_tables[:, :7] = ctx.block_tables
    context_lens = ctx.context_lens.clone()
    out = torch.empty_like(q)
    run = lambda: paged_decode_attention(q, kc, vc, context_lens, block_tables, SCALE, out=out)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    g = torch.Generator().manual_seed(8)
    new_lens = torch.randint(0, 2049, (16,), generator=g)
    new_lens[0] = 0  # a padding slot
    new_tables = torch.randperm(kc.shape[0], generator=g)[: 16 * 128].view(16, 128)
    context_lens.copy_(new_lens)
    block_tables.copy_(new_tables)
    graph.replay()
    torch.cuda.synchronize()
    cu = torch.arange(17, dtype=torch.int32, device="cuda")
    want = paged_attention_ref(q, kc, vc, cu, context_lens, block_tables, SCALE)
    torch.testing.assert_close(out.float(), want.float(), **BF16_TOL)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


# ---------------------------------------------------------------- cascade: a prefix the whole decode batch shares


def shared_prefix_step(prefix_blocks, own_lens, block_size, seed=0, **kw):
    "A decode step whose sequences all start with the same `prefix_blocks` blocks, then `own_lens` tokens of their own."
    q, kc, vc, ctx = random_step(
        [1] * len(own_lens),
        [prefix_blocks * block_size + n for n in own_lens],
        block_size,
        seed=seed,
        spare_blocks=prefix_blocks,
        **kw,
    )
    tables = ctx.block_tables.clone()
    tables[:, :prefix_blocks] = tables[0, :prefix_blocks]  # every row points at row 0's prefix blocks
    lens = ctx.context_lens
    return (
        q,
        kc,
        vc,
        AttentionMetadata.build(
            [1] * len(own_lens),
            lens.tolist(),
            [[b for b in row if b >= 0] for row in tables.tolist()],
            block_size,
            device=q.device,
        ),
    )


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cascade_decode_matches_reference(block_size, group, num_splits):
    q, kc, vc, ctx = shared_prefix_step(
        3, [1, 9, 40, 17, 64], block_size, heads=2 * group, kv_heads=2, seed=block_size + group
    )
    prefix = shared_prefix_len(ctx.block_tables.cpu().numpy(), ctx.context_lens.cpu().numpy(), block_size)
    assert prefix == 3 * block_size
    out = paged_decode_attention(
        q,
        kc,
        vc,
        ctx.context_lens,
        ctx.block_tables,
        0.3,
        num_splits=num_splits,
        block_n=16,
        shared_prefix_len=torch.tensor([prefix], dtype=torch.int32, device=DEVICE),
    )
    torch.testing.assert_close(out, ref(q, kc, vc, ctx, 0.3), **CPU_TOL)


def test_cascade_with_padding_rows_and_empty_prefix():
    "CUDA-graph padding rows (length 0) get zeros; a shared length of 0 is plain decode."
    q, kc, vc, ctx = shared_prefix_step(2, [3, 5, 7], 4, seed=9)
    lens = ctx.context_lens.clone()
    lens[2] = 0
    want = ref(q, kc, vc, ctx, 0.5)
    for prefix, splits in itertools.product((8, 0), (1, 2)):  # 1: the prefix folded in, 2: merged
        out = paged_decode_attention(
            q,
            kc,
            vc,
            lens,
            ctx.block_tables,
            0.5,
            num_splits=splits,
            block_n=16,
            shared_prefix_len=torch.tensor([prefix], dtype=torch.int32, device=DEVICE),
        )
        torch.testing.assert_close(out[:2], want[:2], **CPU_TOL)
        assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_cascade_bfloat16():
    q, kc, vc, ctx = shared_prefix_step(4, [2, 30, 11], 16, heads=4, kv_heads=2, dim=16, dtype=torch.bfloat16, seed=10)
    out = paged_decode_attention(
        q,
        kc,
        vc,
        ctx.context_lens,
        ctx.block_tables,
        0.25,
        block_n=16,
        shared_prefix_len=torch.tensor([64], dtype=torch.int32, device=DEVICE),
    )
    torch.testing.assert_close(out.float(), ref(q, kc, vc, ctx, 0.25).float(), **BF16_TOL)


def test_cascade_rejects_a_bad_prefix_tensor():
    q, kc, vc, ctx = shared_prefix_step(1, [2, 3], 4)
    for bad in (
        torch.tensor([4], dtype=torch.int64, device=DEVICE),
        torch.tensor([4, 4], dtype=torch.int32, device=DEVICE),
    ):
        with pytest.raises(ValueError, match="shared_prefix_len"):
            paged_decode_attention(q, kc, vc, ctx.context_lens, ctx.block_tables, 0.5, shared_prefix_len=bad)


def test_shared_prefix_len_and_use_cascade():
    tables = np.array([[5, 6, 7, -1], [5, 6, 8, 9], [5, 6, 7, 3]], dtype=np.int32)
    assert shared_prefix_len(tables, np.array([12, 16, 16]), 4) == 8  # blocks 5, 6
    assert shared_prefix_len(tables[[0, 2]], np.array([12, 16]), 4) == 8  # 5, 6, 7 shared, but row 0 ends in 7
    assert shared_prefix_len(tables[[0, 2]], np.array([13, 16]), 4) == 12
    assert shared_prefix_len(tables[:1], np.array([12]), 4) == 0  # one sequence: nothing to share
    assert shared_prefix_len(np.array([[1, 2], [3, 2]], dtype=np.int32), np.array([8, 8]), 4) == 0
    assert shared_prefix_len(np.array([[1, 2], [1, 2]], dtype=np.int32), np.array([8, 5]), 4) == 4
    assert use_cascade(256, 1024) and use_cascade(193, 1024) and not use_cascade(192, 1024)
    assert use_cascade(128, 2048) and not use_cascade(128, 1024)
    shared = np.column_stack([np.full(256, 3), np.full(256, 4), np.arange(10, 266)]).astype(np.int32)
    assert cascade_prefix_len(shared, np.full(256, 1100), 512) == 1024  # pays: read it once
    assert cascade_prefix_len(shared[:64], np.full(64, 1100), 512) == 0  # too few sequences
    assert not use_cascade(256, CASCADE_MIN_PREFIX - 16) and not use_cascade(1, 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_cascade_batch_256(block_size):
    g = torch.Generator().manual_seed(11)
    own = torch.randint(1, 512, (256,), generator=g).tolist()
    q, kc, vc, ctx = shared_prefix_step(4096 // block_size // 4, own, block_size, seed=12, **QWEN)
    prefix = torch.tensor([1024], dtype=torch.int32, device="cuda")
    want = ref(q, kc, vc, ctx, SCALE).float()
    for splits in (1, None):
        out = paged_decode_attention(
            q, kc, vc, ctx.context_lens, ctx.block_tables, SCALE, num_splits=splits, shared_prefix_len=prefix
        )
        torch.testing.assert_close(out.float(), want, **BF16_TOL)


# ---- q/k norm, rotary embedding and the KV write in one kernel (notebook 06) ---------------------------------------


def plain_prologue(qkv, heads, kv_heads, dim, q_norm, k_norm, rope, positions, slots, k_cache, v_cache):
    "The model's plain path: split, RMSNorm per head, rotate, then the reference write."
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(-1, heads, dim), k.reshape(-1, kv_heads, dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = rope(positions, q, k)
    store_kvcache_ref(k, v.reshape(-1, kv_heads, dim), k_cache, v_cache, slots)
    return q


def check_prologue(dtype, heads, kv_heads, dim, norm, device=DEVICE, n=7, tol=2e-5):
    from minivllm.layers.layernorm import RMSNorm
    from minivllm.layers.rotary_embedding import get_rope

    g = torch.Generator().manual_seed(heads * dim)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(device, dtype)
    q_norm = k_norm = None
    if norm:
        q_norm, k_norm = RMSNorm(dim).to(device, dtype), RMSNorm(dim).to(device, dtype)
        with torch.no_grad():
            (
                q_norm.weight.copy_(torch.rand(dim, generator=g) + 0.5),
                k_norm.weight.copy_(torch.rand(dim, generator=g) + 0.5),
            )
    rope = get_rope(dim, dim, 4096, 1e6).to(device)
    positions = torch.randint(0, 4096, (n,), generator=g).to(device)
    slots = torch.tensor([0, 3, -1, 9, 22, 23, 10][:n]).to(device)  # a padding token (slot -1) in the middle
    caches = [torch.zeros(6, 4, kv_heads, dim, device=device, dtype=dtype) for _ in range(4)]
    with torch.no_grad():
        want = plain_prologue(qkv, heads, kv_heads, dim, q_norm, k_norm, rope, positions, slots, *caches[:2])
        got = qk_norm_rope_store(
            qkv,
            heads,
            kv_heads,
            dim,
            q_norm.weight if norm else None,
            k_norm.weight if norm else None,
            1e-6,
            rope.cos_sin_cache,
            positions,
            slots,
            *caches[2:],
        )
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[2], caches[0], atol=tol, rtol=tol)
    assert torch.equal(caches[3], caches[1])  # the values are copied, bit for bit


@pytest.mark.parametrize("heads,kv_heads,dim,norm", [(4, 2, 16, True), (3, 1, 32, False), (16, 8, 128, True)])
def test_qk_norm_rope_store_matches_the_plain_path(heads, kv_heads, dim, norm):
    check_prologue(torch.float32, heads, kv_heads, dim, norm)


def test_qk_norm_rope_store_half_precision():
    check_prologue(torch.float16, 4, 2, 16, True, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qk_norm_rope_store_bfloat16_on_gpu():
    check_prologue(torch.bfloat16, 16, 8, 128, True, n=7, tol=2e-2)


def test_qk_norm_rope_store_rejects_mismatches():
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    table, pos, slots = (
        torch.zeros(64, 16, device=DEVICE),
        torch.zeros(3, dtype=torch.long, device=DEVICE),
        torch.zeros(3, dtype=torch.long, device=DEVICE),
    )

    def call(qkv, dim=16, c=cache):
        return qk_norm_rope_store(qkv, 4, 2, dim, None, None, 1e-6, table, pos, slots, c, c.clone())

    with pytest.raises(ValueError, match="qkv must be"):
        call(torch.zeros(3, 100, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        call(torch.zeros(3, 8 * 12, device=DEVICE), dim=12)
    with pytest.raises(ValueError, match="do not fit"):
        call(torch.zeros(3, 8 * 16, device=DEVICE, dtype=torch.float16))


def check_rope_decode(
    dtype, heads, kv_heads, dim, norm, page=4, lens=(7, 5, 1, 0, 13), device=DEVICE, tol=2e-5, merge_in_kernel=False
):
    """`rope_decode_attention` against the pair it replaces (`qk_norm_rope_store`, then `paged_decode_attention`) on
    copies of one cache: the output, the keys written, the values bit for bit. A context of 0 is a padding row."""
    from minivllm.layers.rotary_embedding import get_rope

    g = torch.Generator().manual_seed(heads * dim + page)
    width = max(-(-n // page) for n in lens)
    blocks = torch.randperm(len(lens) * width, generator=g).view(len(lens), width).to(torch.int32)
    tables = torch.where(torch.arange(width)[None, :] * page < torch.tensor(lens)[:, None], blocks, -1)
    slots = [int(tables[i, (n - 1) // page]) * page + (n - 1) % page if n else -1 for i, n in enumerate(lens)]
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    caches = [rand(len(lens) * width, page, kv_heads, dim)] * 2 + [rand(len(lens) * width, page, kv_heads, dim)] * 2
    kc_pair, kc_one, vc_pair, vc_one = (c.clone() for c in caches)
    weights = (rand(dim) * 0.2 + 1, rand(dim) * 0.2 + 1, 1e-6) if norm else (None, None, 0.0)
    rope = get_rope(dim, dim, 4096, 1e6).to(device)
    qkv = rand(len(lens), (heads + 2 * kv_heads) * dim)
    pos = torch.tensor([max(n - 1, 0) for n in lens], device=device)
    slots_t, lens_t = torch.tensor(slots, device=device), torch.tensor(lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    q = qk_norm_rope_store(qkv, heads, kv_heads, dim, *weights, rope.cos_sin_cache, pos, slots_t, kc_pair, vc_pair)
    want = paged_decode_attention(q, kc_pair, vc_pair, lens_t, tables, dim**-0.5)
    got = rope_decode_attention(
        qkv,
        (heads, kv_heads, dim),
        weights,
        rope.cos_sin_cache,
        pos,
        slots_t,
        kc_one,
        vc_one,
        lens_t,
        tables,
        dim**-0.5,
        merge_in_kernel=merge_in_kernel,
    )
    assert not torch.equal(kc_pair, caches[0])  # the pair wrote keys: the check below compares something
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(kc_one, kc_pair, atol=tol, rtol=tol)
    assert torch.equal(vc_one, vc_pair)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,norm,page",
    [(4, 2, 16, True, 4), (3, 1, 32, False, 16), (16, 8, 128, True, 16), (4, 2, 8, True, 4)],
)
def test_rope_decode_attention_matches_the_pair_it_replaces(heads, kv_heads, dim, norm, page):
    check_rope_decode(torch.float32, heads, kv_heads, dim, norm, page)


def test_rope_decode_attention_half_precision():
    check_rope_decode(torch.float16, 4, 2, 16, True, tol=2e-2)


def test_rope_decode_attention_merges_its_splits_in_the_last_one():
    """A sequence long enough to split its KV: with `merge_in_kernel`, the split that stores the last part merges them
    all (no merge kernel), and leaves each pair's counter at zero for the next step: a second step checks the same."""
    from minivllm.kernels import rope_decode
    from minivllm.kernels.decode_plan import decode_tiles, num_sms, plan_decode

    tiles = decode_tiles(2, False, True, DEVICE == "cuda")
    plan = plan_decode(2, 4, 2, 1008, num_sms(torch.device(DEVICE)), False, tiles.block_n, None, tiles.per_sm)
    assert plan.use_splits and plan.num_splits >= 2
    check_rope_decode(torch.float32, 4, 2, 16, True, page=16, lens=(1000, 0))  # the merge kernel
    for _ in range(2):
        check_rope_decode(torch.float32, 4, 2, 16, True, page=16, lens=(1000, 0), merge_in_kernel=True)
    buffers = [c for held in rope_decode._SPLIT_COUNTS.values() for c in held]
    assert buffers and not any(c.any() for c in buffers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("merge_in_kernel", [False, True])
@pytest.mark.parametrize("batch", [1, 8, 32, 64])  # narrow tiles up to 32 sequences, the plain ones past
def test_rope_decode_attention_bfloat16_on_gpu(batch, merge_in_kernel):
    lens = tuple(int(n) for n in torch.randint(1, 3000, (batch,), generator=torch.Generator().manual_seed(batch)))
    check_rope_decode(torch.bfloat16, 16, 8, 128, True, 16, lens + (0,), tol=2e-2, merge_in_kernel=merge_in_kernel)


def test_rope_decode_attention_rejects_mismatches():
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    table, pos, slots = torch.zeros(64, 16, device=DEVICE), *(torch.zeros(3, dtype=torch.long, device=DEVICE),) * 2
    lens, tables = torch.ones(3, dtype=torch.int32, device=DEVICE), torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)

    def call(qkv, lens=lens, tables=tables):
        return rope_decode_attention(
            qkv, (4, 2, 16), (None, None, 0.0), table, pos, slots, cache, cache.clone(), lens, tables, 0.25
        )

    with pytest.raises(ValueError, match="qkv must be"):
        call(torch.zeros(3, 100, device=DEVICE))
    with pytest.raises(ValueError, match="one row per sequence"):
        call(torch.zeros(3, 8 * 16, device=DEVICE), lens=lens[:2])


# --- one row's products (gemv) and the MLP's activation (silu_mul), notebook 06's last section ---


def plain_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("n, k", [(40, 1100), (7, 64), (41, 33)])  # two loop steps; one; N past a 2-row tile
def test_gemv_matches_f_linear(n, k):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(1, k, generator=g).to(DEVICE), (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE)
    torch.testing.assert_close(gemv(x, w), torch.nn.functional.linear(x, w), atol=2e-5, rtol=2e-5)


def test_gemv_fused_with_the_activation():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 300, generator=g).to(DEVICE), (torch.randn(2 * 36, 300, generator=g) * 0.06).to(DEVICE)
    want = plain_silu_and_mul(torch.nn.functional.linear(x, w))
    torch.testing.assert_close(gemv(x, w, fuse_silu=True), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n, k, fuse", [(6, 3000, False), (5, 1100, True), (9, 9000, False)])
def test_gemv_with_the_early_launchs_tiles(monkeypatch, n, k, fuse):
    """The tiles gemv takes when launched early (a whole row of up to 4,096 inputs), in the interpreter (no early
    launch)."""
    from minivllm.kernels import gemv as gemv_module

    tiles = gemv_module.gemv_tiles
    assert tiles(1024, 3072, True) == (1, 4096) and tiles(1024, 3072) == (2, 1024)
    monkeypatch.setattr(gemv_module, "gemv_tiles", lambda n, k, pdl=False: tiles(n, k, True))
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(1, k, generator=g).to(DEVICE), (torch.randn(2 * n if fuse else n, k, generator=g) * k**-0.5)
    want = torch.nn.functional.linear(x, w.to(DEVICE))
    want = plain_silu_and_mul(want) if fuse else want
    torch.testing.assert_close(gemv(x, w.to(DEVICE), fuse_silu=fuse), want, atol=2e-5, rtol=2e-5)


def test_gemv_rejects_what_it_does_not_compute():
    w = torch.zeros(8, 16, device=DEVICE)
    for x, weight, fuse in [
        (torch.zeros(2, 16), w, False),
        (torch.zeros(1, 12), w, False),
        (torch.zeros(1, 16, dtype=torch.float16), w, False),
        (torch.zeros(1, 16), w[:7], True),
    ]:
        with pytest.raises(ValueError, match="gemv takes one row"):
            gemv(x.to(DEVICE), weight, fuse_silu=fuse)


@pytest.mark.parametrize(
    "n, k, residual, fuse",
    [(40, 1100, True, False), (7, 64, False, False), (2 * 36, 300, True, True), (2 * 5, 33, False, True)],
)
def test_norm_gemv_matches_the_norm_then_the_product(n, k, residual, fuse):
    "rms_norm(x + residual) * w_norm, then F.linear (and the activation), against the one kernel; the sum it returns."
    from minivllm.layers.layernorm import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(n + k)
    x, res = torch.randn(1, k, generator=g).to(DEVICE), torch.randn(1, k, generator=g).to(DEVICE)
    nw, w = 1 + 0.1 * torch.randn(k, generator=g).to(DEVICE), (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE)
    normed, total = add_rms_norm(x, res, nw, 1e-6) if residual else (rms_norm(x, nw, 1e-6), x)
    want = torch.nn.functional.linear(normed, w)
    y, carried = norm_gemv(x, res if residual else None, nw, 1e-6, w, fuse_silu=fuse)
    torch.testing.assert_close(y, plain_silu_and_mul(want) if fuse else want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(carried, total, atol=0, rtol=0)
    assert (carried is x) == (not residual)


def test_norm_gemv_rejects_what_it_does_not_compute():
    x, w, nw = torch.zeros(1, 16, device=DEVICE), torch.zeros(8, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="norm_gemv takes one row"):
        norm_gemv(torch.zeros(2, 16, device=DEVICE), None, nw, 1e-6, w)
    with pytest.raises(ValueError, match="residual must match"):
        norm_gemv(x, torch.zeros(1, 8, device=DEVICE), nw, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight must be"):
        norm_gemv(x, None, nw[:8], 1e-6, w)


def test_silu_mul_matches_the_plain_expression():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 2 * 1100, generator=g).to(DEVICE)  # 3-d, two column tiles
    torch.testing.assert_close(silu_mul(x), plain_silu_and_mul(x), atol=2e-6, rtol=2e-6)
    wide = torch.randn(5, 2 * 1100 + 10, generator=g).to(DEVICE)[:, 10:]  # rows not contiguous with each other
    torch.testing.assert_close(silu_mul(wide), plain_silu_and_mul(wide), atol=2e-6, rtol=2e-6)
    assert silu_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)
    with pytest.raises(ValueError, match="even last dimension"):
        silu_mul(torch.zeros(2, 7, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_and_silu_mul_at_qwen3_shapes_on_gpu():
    "bfloat16 at Qwen3-0.6B's four products, and the layers that dispatch to the kernels for one row."
    from minivllm.layers.activation import SiluAndMul
    from minivllm.layers.kernel_policy import apply_policy, kernel_policy
    from minivllm.layers.linear import ReplicatedLinear
    from minivllm.models.qwen3 import Qwen3MLP

    gpu = kernel_policy("cuda", torch.bfloat16, "triton")  # the layers dispatch to the kernels as an engine's do
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]:
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
        want = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(gemv(x, w).float(), want, atol=2e-2, rtol=2e-2)
        if n == 6144:
            torch.testing.assert_close(
                gemv(x, w, fuse_silu=True).float(), plain_silu_and_mul(want), atol=2e-2, rtol=2e-2
            )
    x = torch.randn(16384, 6144, device="cuda", generator=g).bfloat16()
    torch.testing.assert_close(silu_mul(x).float(), plain_silu_and_mul(x), atol=2e-2, rtol=2e-2)
    act = apply_policy(SiluAndMul(), gpu)
    assert act.triton_kernel
    torch.testing.assert_close(act(x).float(), plain_silu_and_mul(x), atol=2e-2, rtol=2e-2)
    layer = apply_policy(ReplicatedLinear(1024, 4096).cuda().bfloat16(), gpu)
    torch.nn.init.normal_(layer.weight, std=0.03)
    for rows in (1, 3):  # one row: gemv; three: cuBLAS
        x = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
        torch.testing.assert_close(
            layer(x).float(), torch.nn.functional.linear(x.float(), layer.weight.float()), atol=2e-2, rtol=2e-2
        )
    mlp = apply_policy(Qwen3MLP(1024, 3072).cuda().bfloat16(), gpu)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.03)
    x = torch.randn(1, 1024, device="cuda", generator=g).bfloat16()
    gate_up = torch.nn.functional.linear(x.float(), mlp.gate_up_proj.weight.float())
    want = torch.nn.functional.linear(plain_silu_and_mul(gate_up), mlp.down_proj.weight.float())
    torch.testing.assert_close(mlp(x).float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_norm_gemv_and_the_decoder_layers_one_row_path_on_gpu():
    "bfloat16 at Qwen3-0.6B's normed products; a decoder layer's one-row path against its plain path."
    from transformers import Qwen3Config

    from minivllm.layers.kernel_policy import apply_policy, kernel_policy
    from minivllm.layers.layernorm import add_rms_norm
    from minivllm.layers.rotary_embedding import get_rope
    from minivllm.models.qwen3 import Qwen3DecoderLayer

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, fuse in [(4096, False), (6144, True)]:
        x, res = (torch.randn(1, 1024, device="cuda", generator=g).bfloat16() for _ in range(2))
        nw = (1 + 0.1 * torch.randn(1024, device="cuda", generator=g)).bfloat16()
        w = (torch.randn(n, 1024, device="cuda", generator=g) * 1024**-0.5).bfloat16()
        normed, total = add_rms_norm(x, res, nw, 1e-6)
        want = torch.nn.functional.linear(normed.float(), w.float())
        y, carried = norm_gemv(x, res, nw, 1e-6, w, fuse_silu=fuse)
        assert torch.equal(carried, total)  # the sum rounds as the plain add does
        torch.testing.assert_close(y.float(), plain_silu_and_mul(want) if fuse else want, atol=2e-2, rtol=2e-2)
    config = Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=1,
        vocab_size=1000,
    )
    layer = Qwen3DecoderLayer(config, get_rope(128, 128, 4096, 1e6)).cuda()  # float32: the paths differ only in
    for p in layer.parameters():  # the order of their sums
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.03)
    apply_policy(layer, kernel_policy("cuda", torch.float32, "triton"))  # a GPU engine's fast paths
    x, res = (torch.randn(1, 1024, device="cuda", generator=g) for _ in range(2))
    pos = torch.tensor([5], device="cuda")
    assert layer.norms_in_products(x)
    fused = [layer(pos, x, r) for r in (res, None)]
    layer.norms_in_products = lambda x: False  # the plain path, for the same row
    plain = [layer(pos, x, r) for r in (res, None)]
    for (out, carried), (want_out, want_carried) in zip(fused, plain):
        torch.testing.assert_close(carried, want_carried, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)])
def test_minivllm_pdl_switches_early_launch(value, on):
    "MINIVLLM_PDL=0 (read once, at import) keeps a one-row step on a capable GPU from launching early."
    env = {k: v for k, v in os.environ.items() if k not in ("MINIVLLM_PDL", "TRITON_INTERPRET")} | (
        {} if value is None else {"MINIVLLM_PDL": value}
    )
    code = (
        "import torch\n"
        "from minivllm.kernels import common\n"
        "common._pdl_capable = lambda index: True\n"  # a Hopper GPU, as far as the decision goes
        "print(common.use_pdl(torch.device('cuda', 0), 1), common.use_pdl(torch.device('cuda', 0), 2))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(on), "False"]


def test_early_launch_only_on_a_capable_gpu_for_one_row(monkeypatch):
    "Programmatic dependent launch: never in the interpreter, on a CPU tensor or past PDL_MAX_ROWS rows."
    monkeypatch.setattr(common, "ENABLE_PDL", True)
    assert not common.use_pdl(torch.device("cpu"))
    if torch.cuda.is_available():
        capable = torch.cuda.get_device_capability()[0] >= 9 and torch.version.hip is None
        assert common.use_pdl(torch.device("cuda"), 1) == capable
        assert not common.use_pdl(torch.device("cuda"), common.PDL_MAX_ROWS + 1)
        monkeypatch.setattr(common, "ENABLE_PDL", False)
        assert not common.use_pdl(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_early_launch_changes_no_bits_on_gpu(monkeypatch):
    """A decode step's kernels (4 layers, batch 1) replayed from CUDA graphs, launched plainly and early: the same bits
    on every replay, and the same results to bfloat16 rounding (launched early, gemv sums a row in one tile)."""
    from tools.pdl_probe import decode_step_kernels

    step = decode_step_kernels(layers=4, context=2048)
    outs = {}
    for early in (False, True):
        monkeypatch.setattr(common, "ENABLE_PDL", early)
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        results = []
        for _ in range(20):  # replayed back to back: a read too early would show as a difference
            graph.replay()
            results.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, results[0]) for r in results)
        outs[early] = results[0]
    assert torch.isfinite(outs[True]).all()
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=2e-2, rtol=2e-2)
