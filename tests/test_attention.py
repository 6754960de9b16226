"""The attention metadata, the PyTorch reference (proved against dense causal attention) and the `Attention` layer.

The batched CPU implementation of the `torch` backend (kernels/torch_attention.py) is proved equal to the reference on
mixed batches (decode rows, prefill chunks over cached prefixes, fresh prompts), with one and many decode groups.

The layer runs on CUDA tensors where there is a GPU; without one its Triton backend runs in Triton's interpreter
(TRITON_INTERPRET is set before any kernel module is imported; see tests/test_kernels.py). flash-attn tests skip
unless flash_attn is importable on a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton decides when a kernel is defined: before minivllm.kernels is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minivllm.kernels import backends, kept_decode_kv  # noqa: E402
from minivllm.kernels.backends import BACKEND_ENV, select_backend  # noqa: E402
from minivllm.kernels.kept_decode_kv import KeptDecodeKV, paged_decode_kept  # noqa: E402
from minivllm.kernels.reference import (
    causal_attention_ref,
    gather_kv,
    paged_attention_ref,  # noqa: E402
    store_kvcache_ref,
    varlen_attention_ref,
)
from minivllm.kernels.torch_attention import (
    causal_attention_sdpa,
    decode_groups,
    gather_padded_kv,  # noqa: E402
    paged_attention_torch,
    paged_decode_torch,
    store_kvcache_torch,
    varlen_attention_torch,
)
from minivllm.layers.attention import Attention, AttentionMetadata  # noqa: E402
from minivllm.layers.attention_backends.base import make_attention_backend  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def dense_causal(q, k, v, scale):
    "Naive attention over a whole sequence [n, heads, dim], no paging: PyTorch's SDPA with is_causal."
    group = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.repeat_interleave(group, 1).transpose(0, 1).float(),
        v.repeat_interleave(group, 1).transpose(0, 1).float(),
        is_causal=True,
        scale=scale,
    )
    return o.transpose(0, 1).to(q.dtype)


class Step:
    "Full random sequences, a cache holding their first (context - query) tokens in shuffled blocks, and the step."

    def __init__(self, q_lens, ctx_lens, block_size, heads, kv_heads, dim=8, seed=0, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.ctx_lens, self.scale = q_lens, ctx_lens, dim**-0.5
        self.full = [tuple(torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)) for n in ctx_lens]
        need = [-(-n // block_size) for n in ctx_lens]
        perm = torch.randperm(sum(need) + 2, generator=g).tolist()
        self.tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
        self.k_cache = torch.zeros(sum(need) + 2, block_size, kv_heads, dim)
        self.v_cache = torch.zeros_like(self.k_cache)
        for (_, k, v), n, m, table in zip(self.full, ctx_lens, q_lens, self.tables):
            for p in range(n - m):
                self.k_cache[table[p // block_size], p % block_size] = k[p]
                self.v_cache[table[p // block_size], p % block_size] = v[p]
        self.ctx = AttentionMetadata.build(q_lens, ctx_lens, self.tables, block_size)
        self.q, self.k, self.v = (
            torch.cat([f[i][n - m :] for f, n, m in zip(self.full, ctx_lens, q_lens)]) for i in range(3)
        )
        if device != "cpu":
            for name in ("k_cache", "v_cache", "q", "k", "v"):
                setattr(self, name, getattr(self, name).to(device))
            self.ctx = AttentionMetadata.build(q_lens, ctx_lens, self.tables, block_size, device=device)

    def dense(self):
        "The step's expected output, from naive dense attention over each whole sequence."
        return torch.cat(
            [
                dense_causal(q, k, v, self.scale)[n - m :]
                for (q, k, v), n, m in zip(self.full, self.ctx_lens, self.q_lens)
            ]
        )


MIXED = dict(q_lens=[1, 5, 6, 1, 11], ctx_lens=[7, 9, 6, 1, 30])  # decode, chunk over a prefix, fresh prompts


# ---------------------------------------------------------------- metadata


def test_attention_metadata_build_running_example():
    ctx = AttentionMetadata.build([1, 5, 6], [7, 9, 6], [[3, 9], [5, 2, 7], [0, 11]], 4)
    assert not ctx.is_decode_only
    assert ctx.cu_seqlens_q.tolist() == [0, 1, 6, 12] and ctx.cu_seqlens_k.tolist() == [0, 7, 16, 22]
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (6, 9)
    assert ctx.slot_mapping.tolist() == [38, 8, 9, 10, 11, 28, 0, 1, 2, 3, 44, 45]
    assert ctx.context_lens.tolist() == [7, 9, 6]
    assert ctx.block_tables.tolist() == [[3, 9, -1], [5, 2, 7], [0, 11, -1]]
    assert ctx.cu_seqlens_q.dtype == ctx.context_lens.dtype == ctx.block_tables.dtype == torch.int32
    assert AttentionMetadata.build([1, 1], [3, 8], [[0], [1, 2]], 4).is_decode_only


def test_attention_metadata_defaults_and_decode_only():
    "Metadata is a plain value passed to each forward: only the cu_seqlens and the maxima are required."
    cu = torch.tensor([0, 3], dtype=torch.int32)
    meta = AttentionMetadata(cu, cu, 3, 3)
    assert meta.slot_mapping is None and meta.context_lens is None and meta.block_tables is None
    assert meta.shared_prefix_len is None and not meta.is_decode_only
    one = AttentionMetadata.build([1], [3], [[2]], 4)
    assert one.is_decode_only and one.slot_mapping.tolist() == [2 * 4 + 2]
    assert one.block_tables.tolist() == [[2]] and one.context_lens.tolist() == [3]
    empty = AttentionMetadata.build([], [], [], 4)
    assert empty.cu_seqlens_q.tolist() == [0] and tuple(empty.block_tables.shape) == (0, 0)


# ---------------------------------------------------------------- the reference, proved


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_dense_causal_attention(block_size, group):
    step = Step(MIXED["q_lens"], MIXED["ctx_lens"], block_size, heads=2 * group, kv_heads=2, seed=group)
    store_kvcache_ref(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
    out = paged_attention_ref(
        step.q,
        step.k_cache,
        step.v_cache,
        step.ctx.cu_seqlens_q,
        step.ctx.context_lens,
        step.ctx.block_tables,
        step.scale,
    )
    torch.testing.assert_close(out, step.dense(), **TOL)


def test_gather_kv_and_store_ref():
    step = Step([3], [10], 4, heads=2, kv_heads=1)
    slots = torch.cat([step.ctx.slot_mapping, torch.tensor([-1, -5])])
    junk = torch.full((2, 1, 8), 7.0)
    before = step.k_cache.clone()
    store_kvcache_ref(torch.cat([step.k, junk]), torch.cat([step.v, junk]), step.k_cache, step.v_cache, slots)
    assert torch.equal(gather_kv(step.k_cache, step.ctx.block_tables[0], 10), step.full[0][1])
    assert torch.equal(gather_kv(step.v_cache, step.ctx.block_tables[0], 10), step.full[0][2])
    changed = (step.k_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {s // 4 for s in step.ctx.slot_mapping.tolist()}  # only the slots' blocks changed


def test_causal_attention_ref_single_query_sees_everything():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    want = torch.softmax(torch.einsum("hd,khd->hk", q[0], k.repeat_interleave(2, 1)) * 0.3, -1)
    want = torch.einsum("hk,khd->hd", want, v.repeat_interleave(2, 1))
    torch.testing.assert_close(causal_attention_ref(q, k, v, 0.3)[0], want, **TOL)


def test_varlen_reference_matches_dense():
    g = torch.Generator().manual_seed(2)
    lens = [4, 1, 9]
    qkv = [torch.randn(14, h, 8, generator=g) for h in (4, 2, 2)]
    cu = torch.tensor([0, 4, 5, 14], dtype=torch.int32)
    out = varlen_attention_ref(*qkv, cu, cu, 0.35)
    starts = [0, 4, 5]
    want = torch.cat([dense_causal(*(t[s : s + n] for t in qkv), 0.35) for s, n in zip(starts, lens)])
    torch.testing.assert_close(out, want, **TOL)


# ---------------------------------------------------------------- the batched torch backend vs the reference


def ref_of(step, q=None):
    c = step.ctx
    return paged_attention_ref(
        step.q if q is None else q,
        step.k_cache,
        step.v_cache,
        c.cu_seqlens_q,
        c.context_lens,
        c.block_tables,
        step.scale,
    )


def test_decode_groups_cut_sorted_lengths_by_padded_size():
    assert decode_groups([], 4, 12) == []
    assert decode_groups([7, 8, 10], 4, 12) == [(0, 1), (1, 2), (2, 3)]  # 2 x 8 = 16 > 12 already
    assert decode_groups([7, 8, 10], 4, 64) == [(0, 3)]  # 3 x 12 = 36 <= 64
    assert decode_groups([1, 2, 3, 4, 5], 4, 8) == [(0, 2), (2, 4), (4, 5)]  # pairs of one block each
    assert decode_groups([3, 100], 16, 32) == [(0, 1), (1, 2)]  # longer than the budget alone: its own group
    assert decode_groups([16, 16, 16, 17], 16, 48) == [(0, 3), (3, 4)]


def test_gather_padded_kv_matches_gather_kv_row_by_row():
    step = Step([1, 1, 1], [5, 17, 1], 4, heads=4, kv_heads=2, seed=3)
    padded = gather_padded_kv(step.k_cache, step.ctx.block_tables, 17)
    assert padded.shape == (3, 20, 2, 8)  # 17 rounded up to whole blocks of 4
    for i, n in enumerate(step.ctx_lens):
        assert torch.equal(padded[i, :n], gather_kv(step.k_cache, step.ctx.block_tables[i], n))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_torch_backend_matches_reference_on_mixed_batch(block_size, group):
    step = Step(MIXED["q_lens"], MIXED["ctx_lens"], block_size, heads=2 * group, kv_heads=2, seed=10 + group)
    store_kvcache_ref(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
    c = step.ctx
    out = paged_attention_torch(
        step.q, step.k_cache, step.v_cache, c.cu_seqlens_q, c.context_lens, c.block_tables, step.scale
    )
    torch.testing.assert_close(out, ref_of(step), **TOL)
    torch.testing.assert_close(out, step.dense(), **TOL)


@pytest.mark.parametrize("group_bytes", [1, 12 * 2 * 8 * 4, 1 << 30])  # every sequence alone, a few, all in one
def test_paged_decode_torch_matches_reference_for_any_grouping(group_bytes):
    lens = [5, 17, 1, 30, 12, 12, 3, 29]
    step = Step([1] * len(lens), lens, 4, heads=8, kv_heads=2, seed=4)
    store_kvcache_ref(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
    out = paged_decode_torch(
        step.q,
        step.k_cache,
        step.v_cache,
        step.ctx.context_lens,
        step.ctx.block_tables,
        step.scale,
        group_bytes=group_bytes,
    )
    torch.testing.assert_close(out, ref_of(step), **TOL)
    torch.testing.assert_close(out, step.dense(), **TOL)


def test_paged_decode_torch_empty_context_gives_zeros_like_the_reference():
    "A padding slot (context length 0, no blocks) reads nothing and returns zeros; the others are unaffected."
    step = Step([1, 1], [6, 9], 4, heads=4, kv_heads=2, seed=5)
    store_kvcache_ref(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
    lens = torch.tensor([6, 0, 9], dtype=torch.int32)
    tables = torch.cat(
        [step.ctx.block_tables[:1], torch.full((1, 3), -1, dtype=torch.int32), step.ctx.block_tables[1:]]
    )
    q = torch.cat([step.q[:1], torch.randn(1, 4, 8), step.q[1:]])
    cu = torch.arange(4, dtype=torch.int32)
    out = paged_decode_torch(q, step.k_cache, step.v_cache, lens, tables, step.scale)
    want = paged_attention_ref(q, step.k_cache, step.v_cache, cu, lens, tables, step.scale)
    assert torch.equal(out[1], torch.zeros(4, 8)) and torch.equal(want[1], torch.zeros(4, 8))
    torch.testing.assert_close(out, want, **TOL)


def test_paged_decode_torch_bfloat16_cache():
    lens = [40, 3, 77]
    step = Step([1, 1, 1], lens, 16, heads=4, kv_heads=1, seed=6)
    store_kvcache_ref(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
    kc, vc, q = step.k_cache.bfloat16(), step.v_cache.bfloat16(), step.q.bfloat16()
    out = paged_decode_torch(q, kc, vc, step.ctx.context_lens, step.ctx.block_tables, step.scale)
    want = paged_attention_ref(
        q, kc, vc, step.ctx.cu_seqlens_q, step.ctx.context_lens, step.ctx.block_tables, step.scale
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)  # both: float32 math, one rounding


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=7),
    block_size=st.sampled_from([1, 2, 4, 16]),
    group=st.sampled_from([1, 2, 3]),
    group_bytes=st.sampled_from([1, 256, 1 << 20]),
    seed=st.integers(0, 2**16),
)
def test_torch_backend_matches_reference_on_random_steps(seqs, block_size, group, group_bytes, seed):
    "Any mix of decode tokens, chunks over cached prefixes and fresh prompts: the batched backend equals the reference."
    q_lens = [q for q, _ in seqs]
    ctx_lens = [q + cached for q, cached in seqs]
    step = Step(q_lens, ctx_lens, block_size, heads=2 * group, kv_heads=2, seed=seed)
    store_kvcache_ref(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
    c = step.ctx
    if all(n == 1 for n in q_lens):
        out = paged_decode_torch(
            step.q, step.k_cache, step.v_cache, c.context_lens, c.block_tables, step.scale, group_bytes=group_bytes
        )
    else:
        out = paged_attention_torch(
            step.q, step.k_cache, step.v_cache, c.cu_seqlens_q, c.context_lens, c.block_tables, step.scale
        )
    torch.testing.assert_close(out, ref_of(step), **TOL)


@pytest.mark.parametrize("slots", [[9, 0, 17, 4], [9, -1, 17, -1], []])
def test_store_kvcache_torch_matches_reference(slots):
    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(len(slots), 2, 8, generator=g), torch.randn(len(slots), 2, 8, generator=g)
    caches = [torch.randn(5, 4, 2, 8, generator=g) for _ in range(2)]
    want = [c.clone() for c in caches]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    store_kvcache_ref(k, v, want[0], want[1], slot_mapping)
    store_kvcache_torch(k, v, caches[0], caches[1], slot_mapping)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    half = [c.bfloat16() for c in caches]  # k, v cast to the cache's dtype
    store_kvcache_torch(k, v, half[0], half[1], slot_mapping)
    assert torch.equal(half[0], want[0].bfloat16()) and torch.equal(half[1], want[1].bfloat16())


@pytest.mark.parametrize("n, length", [(1, 1), (1, 9), (4, 9), (9, 9)])
def test_causal_attention_sdpa_matches_reference(n, length):
    g = torch.Generator().manual_seed(n * 100 + length)
    q, k, v = (
        torch.randn(n, 6, 8, generator=g),
        torch.randn(length, 2, 8, generator=g),
        torch.randn(length, 2, 8, generator=g),
    )
    torch.testing.assert_close(causal_attention_sdpa(q, k, v, 0.3), causal_attention_ref(q, k, v, 0.3), **TOL)


def test_varlen_attention_torch_matches_reference():
    "Whole prompts and prompts whose queries are only their last tokens (cu_seqlens_k longer than cu_seqlens_q)."
    g = torch.Generator().manual_seed(7)
    cu_q = torch.tensor([0, 4, 5, 14, 14], dtype=torch.int32)  # the last sequence has no query rows
    cu_k = torch.tensor([0, 6, 7, 16, 18], dtype=torch.int32)
    q, k, v = torch.randn(14, 4, 8, generator=g), torch.randn(18, 2, 8, generator=g), torch.randn(18, 2, 8, generator=g)
    torch.testing.assert_close(
        varlen_attention_torch(q, k, v, cu_q, cu_k, 0.35), varlen_attention_ref(q, k, v, cu_q, cu_k, 0.35), **TOL
    )
    cu = torch.tensor([0, 4, 5, 14], dtype=torch.int32)
    torch.testing.assert_close(
        varlen_attention_torch(q, k[:14], v[:14], cu, cu, 0.35),
        varlen_attention_ref(q, k[:14], v[:14], cu, cu, 0.35),
        **TOL,
    )


@pytest.mark.gpu
def test_torch_backend_on_cuda_matches_reference():
    "The batched torch backend is plain PyTorch: forced on a GPU (MINIVLLM_ATTENTION_BACKEND=torch) it must agree too."
    for q_lens, ctx_lens in [(MIXED["q_lens"], MIXED["ctx_lens"]), ([1, 1, 1], [300, 5, 1000])]:
        step = Step(q_lens, ctx_lens, 16, heads=16, kv_heads=8, dim=128, seed=13, device="cuda")
        for name in ("k_cache", "v_cache", "q", "k", "v"):
            setattr(step, name, getattr(step, name).to(torch.bfloat16))
        store_kvcache_torch(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
        c = step.ctx
        out = paged_attention_torch(
            step.q, step.k_cache, step.v_cache, c.cu_seqlens_q, c.context_lens, c.block_tables, step.scale
        )
        torch.testing.assert_close(out.float(), ref_of(step).float(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- backend choice


def test_select_backend(monkeypatch):
    "TRITON_INTERPRET is read once, at import (backends.INTERPRET): the test sets that flag, not the variable."
    assert select_backend("cpu") == "torch"
    assert select_backend("cpu", 256) == "torch"
    assert select_backend("cpu", 16, "torch") == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'fast'.*torch, triton, flash_attn"):
        select_backend("cpu", 16, "fast")
    with pytest.raises(
        ValueError,
        match="'flash_attn' is not available here: flash-attn needs a CUDA device, got cpu "
        r"\(choices: torch, triton, flash_attn",
    ):
        select_backend("cpu", 16, "flash_attn")
    monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend("cpu")
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend("cpu") == "torch"
    monkeypatch.setattr(backends, "INTERPRET", True)
    assert select_backend("cpu", 16, "triton") == "triton"  # for tests: Triton's interpreter
    monkeypatch.setattr(backends, "INTERPRET", False)
    with pytest.raises(ValueError, match="need a CUDA device"):
        select_backend("cpu", 16, "triton")


def test_select_backend_rejects_an_unknown_phase():
    with pytest.raises(ValueError, match="unknown phase 'both': choose one of decode, prefill"):
        select_backend("cpu", 16, phase="both")


def test_the_measured_table_prefers_triton_for_decode_and_flash_attn_for_prefill():
    assert backends.faster("decode") == "triton" and backends.faster("prefill") == "flash_attn"
    for phase, shapes in backends.MEASURED_US.items():
        assert phase in backends.PHASES and len(shapes) >= 5
        assert all(triton > 0 and flash > 0 for triton, flash in shapes.values())


@pytest.fixture
def fake_gpu(monkeypatch):
    "A CUDA device of a given compute capability with a given flash-attn version, on any machine."

    def fake(version: int | None, capability: tuple[int, int] = (9, 0)):
        monkeypatch.setattr(backends, "flash_attn_version", lambda: version)
        monkeypatch.setattr(backends, "cuda_capability", lambda device: capability)
        monkeypatch.setattr(backends, "INTERPRET", False)

    return fake


def test_auto_picks_each_phase_faster_backend_where_flash_attn_4_runs(fake_gpu):
    fake_gpu(4)
    bf16 = dict(dtype=torch.bfloat16)
    assert select_backend("cuda", 16, phase="decode", **bf16) == "triton"
    assert select_backend("cuda", 16, phase="prefill", **bf16) == "flash_attn"  # any block size
    assert select_backend("cuda", 16, "flash_attn", phase="decode", **bf16) == "flash_attn"  # asked for: both phases
    assert select_backend("cuda", 16, "triton", phase="prefill", **bf16) == "triton"
    for dtype in (torch.float32, torch.float8_e4m3fn):  # flash-attn computes in 16 bits only
        assert select_backend("cuda", 16, dtype=dtype, phase="prefill") == "triton"
    with pytest.raises(ValueError, match="flash-attn computes in float16 or bfloat16, not float32"):
        select_backend("cuda", 16, "flash_attn", dtype=torch.float32)


@pytest.mark.parametrize(
    "version, capability, block_size, reason",
    [
        (None, (9, 0), 16, r"flash-attn is not installed \(pip install flash-attn-4 on Hopper or Blackwell GPUs"),
        (4, (8, 0), 16, r"flash-attn-4 needs a Hopper or Blackwell GPU \(compute capability 9.0\+\), got 8.0"),
        (2, (8, 0), 16, r"flash-attn 2's paged KV needs block_size % 256 == 0, got 16 \(flash-attn-4 takes any"),
    ],
)
def test_where_flash_attn_cannot_run_auto_falls_back_and_a_request_says_why(
    fake_gpu, version, capability, block_size, reason
):
    fake_gpu(version, capability)
    assert select_backend("cuda", block_size, dtype=torch.bfloat16, phase="prefill") == "triton"
    with pytest.raises(ValueError, match=reason):
        select_backend("cuda", block_size, "flash_attn", dtype=torch.bfloat16)


def test_flash_attn_2_runs_on_blocks_of_256(fake_gpu):
    fake_gpu(2, (8, 0))
    assert select_backend("cuda", 256, dtype=torch.float16, phase="prefill") == "flash_attn"
    assert select_backend("cuda", 256, dtype=torch.float16, phase="decode") == "triton"


@pytest.mark.gpu
def test_select_backend_on_cuda():
    version = backends.flash_attn_version()
    hopper = torch.cuda.get_device_capability()[0] >= 9
    flash_prefill = version == 4 and hopper
    assert select_backend("cuda", 16, dtype=torch.bfloat16, phase="decode") == "triton"
    assert select_backend("cuda", 16, dtype=torch.bfloat16, phase="prefill") == (
        "flash_attn" if flash_prefill else "triton"
    )
    assert select_backend("cuda", 16, dtype=torch.float32, phase="prefill") == "triton"
    if version is None:
        with pytest.raises(ValueError, match="flash-attn is not installed"):
            select_backend("cuda", 16, "flash_attn", dtype=torch.bfloat16)


# ---------------------------------------------------------------- the layer


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_attention_layer_mixed_step(backend, block_size):
    step = Step(MIXED["q_lens"], MIXED["ctx_lens"], block_size, heads=4, kv_heads=2, seed=block_size, device=DEVICE)
    attn = Attention(4, 8, step.scale, 2, backend=make_attention_backend(backend))
    attn.k_cache, attn.v_cache = step.k_cache, step.v_cache
    out = attn(step.q, step.k, step.v, step.ctx)
    torch.testing.assert_close(out.cpu(), step.dense(), **TOL)
    for i, (_, k, _) in enumerate(step.full):  # every sequence's whole K is now in the cache
        torch.testing.assert_close(gather_kv(attn.k_cache, step.ctx.block_tables[i], step.ctx_lens[i]).cpu(), k)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_layer_decode_step(backend, monkeypatch):
    "A decode-only step (one token per sequence) with the backend chosen from MINIVLLM_ATTENTION_BACKEND."
    monkeypatch.setenv(BACKEND_ENV, backend)
    step = Step([1, 1, 1], [5, 17, 1], 4, heads=8, kv_heads=2, seed=9, device=DEVICE)
    attn = Attention(8, 8, step.scale, 2, backend=make_attention_backend(select_backend(DEVICE, 4)))
    assert attn.backend.name == backend and step.ctx.is_decode_only
    attn.k_cache, attn.v_cache = step.k_cache, step.v_cache
    torch.testing.assert_close(attn(step.q, step.k, step.v, step.ctx).cpu(), step.dense(), **TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_layer_without_cache(backend):
    step = Step([7, 3, 12], [7, 3, 12], 4, heads=4, kv_heads=1, seed=11, device=DEVICE)
    attn = Attention(4, 8, step.scale, 1, backend=make_attention_backend(backend))
    whole = [t.to(DEVICE) for t in step.full[2]]
    torch.testing.assert_close(attn(*whole).cpu(), dense_causal(*step.full[2], step.scale), **TOL)  # no metadata
    meta = AttentionMetadata(step.ctx.cu_seqlens_q, step.ctx.cu_seqlens_k, max_seqlen_q=12, max_seqlen_k=12)
    torch.testing.assert_close(attn(step.q, step.k, step.v, meta).cpu(), step.dense(), **TOL)


def test_attention_layer_runs_decode_steps_on_backend_and_the_others_on_prefill_backend(monkeypatch):
    triton, plain = make_attention_backend("triton"), make_attention_backend("torch")
    used = []

    def recording(backend, method):
        real = getattr(type(backend), method)

        def record(self, *args):
            used.append((self.name, method))  # the backend and the call
            return real(self, *args)

        monkeypatch.setattr(type(backend), method, record)

    for backend in (triton, plain):
        for method in ("store_kv", "decode", "prefill", "varlen"):
            recording(backend, method)
    decode = Step([1, 1], [5, 9], 4, heads=4, kv_heads=2, seed=3, device=DEVICE)
    mixed = Step(MIXED["q_lens"], MIXED["ctx_lens"], 4, heads=4, kv_heads=2, seed=4, device=DEVICE)
    attn = Attention(4, 8, decode.scale, 2, backend=triton, prefill_backend=plain)
    assert "backend=triton, prefill_backend=torch" in repr(attn)
    for step in (decode, mixed):
        attn.k_cache, attn.v_cache = step.k_cache, step.v_cache
        torch.testing.assert_close(attn(step.q, step.k, step.v, step.ctx).cpu(), step.dense(), **TOL)
    assert [backend for backend, method in used if method != "store_kv"] == ["triton", "torch"]
    assert used == [("triton", "store_kv"), ("triton", "decode"), ("torch", "store_kv"), ("torch", "prefill")]


def test_attention_is_an_nn_module_without_cache_state():
    attn = Attention(16, 128, 128**-0.5, 8)
    assert list(attn.state_dict()) == [] and attn.k_cache is None and attn.v_cache is None  # the engine sets them
    assert "num_heads=16, num_kv_heads=8, head_dim=128" in repr(attn)


# ---------------------------------------------------------------- flash-attn (GPU, when installed)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_attn_backend_matches_reference(block_size):
    version = backends.flash_attn_version()
    if version is None or (version == 2 and block_size % 256):
        pytest.skip(f"flash-attn {version or 'absent'}: no paged cache of blocks of {block_size}")
    bf16 = dict(atol=2e-2, rtol=2e-2)
    for q_lens, ctx_lens in [(MIXED["q_lens"], MIXED["ctx_lens"]), ([1, 1, 1], [300, 5, 1000]), ([700], [700])]:
        step = Step(q_lens, ctx_lens, block_size, heads=16, kv_heads=8, dim=128, seed=12, device="cuda")
        for name in ("k_cache", "v_cache", "q", "k", "v"):
            setattr(step, name, getattr(step, name).to(torch.bfloat16))
        outs = {}
        for backend in ("flash_attn", "torch"):
            attn = Attention(16, 128, step.scale, 8, backend=make_attention_backend(backend))
            attn.k_cache, attn.v_cache = step.k_cache.clone(), step.v_cache.clone()
            outs[backend] = attn(step.q, step.k, step.v, step.ctx).float()
        torch.testing.assert_close(outs["flash_attn"], outs["torch"], **bf16)
        # the warm-up's path: K/V token by token
        no_cache = Attention(16, 128, step.scale, 8, backend=make_attention_backend("flash_attn"))
        whole = [t.to(torch.bfloat16) for t in step.full[0]]
        torch.testing.assert_close(
            no_cache(*[t.cuda() for t in whole]).float().cpu(),
            dense_causal(*[t.float() for t in whole], step.scale),
            **bf16,
        )


def test_torch_decode_ignores_stale_values_in_unwritten_slots():
    "Slots past a sequence's end hold what an earlier owner of the block wrote (finite): they must not leak out."
    from minivllm.kernels.reference import paged_attention_ref
    from minivllm.kernels.torch_attention import paged_decode_torch

    torch.manual_seed(0)
    k, v = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    k[3, 2:] = v[3, 2:] = 1e30  # the last block of sequence 0, past its 6 tokens
    q = torch.randn(2, 4, 16)
    tables, lens = torch.tensor([[2, 3], [5, -1]], dtype=torch.int32), torch.tensor([6, 4], dtype=torch.int32)
    out = paged_decode_torch(q, k, v, lens, tables, 0.25)
    ref = paged_attention_ref(q, k, v, torch.arange(3, dtype=torch.int32), lens, tables, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)


class GrowingBatch:
    "Decode steps of `lens` sequences whose blocks (shuffled, room for `steps` more tokens) are allocated up front."

    def __init__(self, lens, block_size=4, heads=4, kv_heads=2, dim=8, steps=8, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.lens, self.bs, self.shape = list(lens), block_size, (heads, kv_heads, dim)
        need = [-(-(n + steps) // block_size) for n in lens]
        perm = torch.randperm(sum(need) + 1, generator=self.g).tolist()
        self.tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
        self.free_block = perm[-1]
        self.k_cache, self.v_cache = (
            torch.randn(sum(need) + 1, block_size, kv_heads, dim, generator=self.g) for _ in range(2)
        )

    def step(self):
        "One more token per sequence, stored in the cache: q and the step's metadata."
        self.lens = [n + 1 for n in self.lens]
        meta = AttentionMetadata.build([1] * len(self.lens), self.lens, self.tables, self.bs)
        heads, kv_heads, dim = self.shape
        k, v = (torch.randn(len(self.lens), kv_heads, dim, generator=self.g) for _ in range(2))
        store_kvcache_ref(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return torch.randn(len(self.lens), heads, dim, generator=self.g), meta

    def decode(self, kept, q, meta):
        "The kept decode and the reference on the same step."
        got = paged_decode_kept(
            q, self.k_cache, self.v_cache, meta.context_lens, meta.block_tables, meta.slot_mapping, 0.3, kept
        )
        want = paged_attention_ref(
            q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, 0.3
        )
        return got, want


def test_kept_decode_kv_appends_while_the_batch_goes_on_and_gathers_anew_on_any_change():
    batch, kept, appended = GrowingBatch([5, 17, 1, 30, 12, 12, 3], steps=12), KeptDecodeKV(), []
    changes = {
        4: lambda: batch.tables[2].__setitem__(0, batch.free_block),  # a block moved
        6: lambda: (batch.lens.pop(3), batch.tables.pop(3)),  # a sequence left
        8: lambda: batch.lens.__setitem__(0, batch.lens[0] - 1),
    }  # not one token longer
    for i in range(10):
        changes.get(i, lambda: None)()
        q, meta = batch.step()
        appended.append(kept.continues(batch.k_cache, meta.context_lens, meta.block_tables))
        got, want = batch.decode(kept, q, meta)
        torch.testing.assert_close(got, want, **TOL)
    assert appended == [False, True, True, True, False, True, False, True, False, True]
    assert kept.continues(batch.k_cache, meta.context_lens + 1, meta.block_tables)
    assert not kept.continues(batch.k_cache.clone(), meta.context_lens + 1, meta.block_tables)  # another cache


def test_kept_decode_kv_grows_past_its_headroom_by_gathering_again(monkeypatch):
    monkeypatch.setattr(kept_decode_kv, "HEADROOM", 2)
    batch, kept, appended = GrowingBatch([3, 9, 6], steps=12), KeptDecodeKV(), []
    for _ in range(12):
        q, meta = batch.step()
        appended.append(kept.continues(batch.k_cache, meta.context_lens, meta.block_tables))
        torch.testing.assert_close(*batch.decode(kept, q, meta), **TOL)
    assert appended.count(False) >= 3 and appended.count(True) >= 6  # rebuilt every few steps, appended between
    assert kept.k.shape[2] >= max(batch.lens)


def test_kept_decode_kv_falls_back_to_the_gather_over_its_budget_or_on_a_padding_slot():
    batch = GrowingBatch([5, 17, 1, 30])
    kept = KeptDecodeKV(max_bytes=1)  # nothing fits: every step gathers, nothing is kept
    for _ in range(3):
        q, meta = batch.step()
        torch.testing.assert_close(*batch.decode(kept, q, meta), **TOL)
        assert kept.k is None
    kept = KeptDecodeKV()
    q, meta = batch.step()
    batch.decode(kept, q, meta)
    lens = meta.context_lens.clone()
    lens[1] = 0  # a padding slot: the plain path, and the kept batch is dropped
    got = paged_decode_kept(q, batch.k_cache, batch.v_cache, lens, meta.block_tables, meta.slot_mapping, 0.3, kept)
    want = paged_attention_ref(q, batch.k_cache, batch.v_cache, meta.cu_seqlens_q, lens, meta.block_tables, 0.3)
    torch.testing.assert_close(got, want, **TOL)
    assert kept.k is None


def test_attention_layer_keeps_decode_kv_and_drops_it_on_a_prefill_step():
    "The torch layer: decode steps keep the batch's K/V; a step with a prefill chunk frees it, and all stay exact."
    batch = GrowingBatch([5, 17, 30], heads=4, kv_heads=2, dim=8)
    layer = Attention(4, 8, 0.3, 2)
    layer.k_cache, layer.v_cache = batch.k_cache, batch.v_cache

    def step(new):
        "Each sequence computes its next `new` tokens through the layer, checked against the reference."
        batch.lens = [n + new for n in batch.lens]
        meta = AttentionMetadata.build([new] * 3, batch.lens, batch.tables, batch.bs)
        q, k, v = (torch.randn(3 * new, h, 8) for h in (4, 2, 2))
        got = layer(q, k, v, meta)
        want = paged_attention_ref(
            q, batch.k_cache, batch.v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, 0.3
        )
        torch.testing.assert_close(got, want, **TOL)

    for _ in range(3):
        step(1)
        assert layer.kept.k is not None
    step(2)  # a chunk of 2 tokens for each: not a decode step
    assert layer.kept.k is None
