"""Tests of minivllm.engine.scheduler, driven by a deterministic fake model.

The fake model's next token is a pure function of the sequence's tokens so far, so whatever the scheduler does
(batching, chunked prefill, preemption, prefix caching), every request must produce exactly the tokens it would
produce running alone. A fake KV cache checks that every step reads the right tokens at the right positions
through the block tables, and never writes into a shared or cached block.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import xxhash
from hypothesis import event, given, settings
from hypothesis import strategies as st

from minivllm.engine.scheduler import POLICIES, ScheduledBatch, Scheduler, check_stop
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

VOCAB = 64


def fake_next_token(token_ids: list[int]) -> int:
    return xxhash.xxh64_intdigest(np.asarray(token_ids, dtype=np.int64).tobytes()) % VOCAB


def reference(prompt: list[int], params: SamplingParams, eos_ids: set[int], max_model_len: int):
    "What the fake model generates for one request running alone: (tokens, finish_reason, stop_reason)."
    tokens = list(prompt)
    while True:
        t = fake_next_token(tokens)
        tokens.append(t)
        out = tokens[len(prompt):]
        if t in eos_ids and not params.ignore_eos:
            return out, "stop", None
        if t in params.stop_token_ids:
            return out, "stop", t
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out, "length", None
        if len(tokens) >= max_model_len:
            return out, "length", None


class FakeRunner:
    "Writes (token, position) into a fake KV cache through the block tables and checks every read."

    def __init__(self, scheduler: Scheduler):
        bm = scheduler.block_manager
        self.bm, self.bs = bm, bm.block_size
        self.kv = [[None] * bm.block_size for _ in range(bm.num_blocks)]

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.bs], pos % self.bs

    def check_context(self, seq: Sequence, end: int) -> None:
        for pos in range(end):
            b, off = self.slot(seq, pos)
            assert self.kv[b][off] == (seq.token_ids[pos], pos), f"seq {seq.seq_id} reads wrong K/V at {pos}"

    def run(self, batch: ScheduledBatch) -> list[int]:
        out = []
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.sample_mask):
            start = seq.num_computed_tokens
            assert len(seq.block_table) * self.bs >= start + n
            self.check_context(seq, start)       # cached prefix and earlier steps are intact
            for pos in range(start, start + n):
                b, off = self.slot(seq, pos)
                block = self.bm.blocks[b]
                assert block.ref_count == 1 and block.hash == -1, "write into a shared or cached block"
                self.kv[b][off] = (seq.token_ids[pos], pos)
            if sample:
                self.check_context(seq, start + n)
                out.append(fake_next_token(seq.token_ids))
        return out


def check_state(sched: Scheduler) -> None:
    "Invariants, computed here independently of the scheduler's own check (which is also called)."
    bm = sched.block_manager
    free = set(bm.free_blocks)
    holders = Counter(b for s in sched.running for b in s.block_table)
    assert not free & set(holders), "a block is both free and in a block table"
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], f"block {block.block_id} ref_count"
    assert len(free) + len(holders) == bm.num_blocks
    assert all(not s.block_table and s.status is SequenceStatus.WAITING for s in sched.waiting)
    assert len(sched.running) <= sched.max_num_seqs
    sched.check_invariants()


def drive(sched: Scheduler, arrivals: list[tuple[int, Sequence]], aborts: dict[int, int] | None = None,
          max_steps: int = 20_000) -> list[ScheduledBatch]:
    "Run requests (arrival step, Sequence) to completion, checking everything after every step."
    runner, pending, batches, step = FakeRunner(sched), sorted(arrivals, key=lambda a: a[0]), [], 0
    aborts = aborts or {}
    while pending or sched.has_unfinished():
        assert step < max_steps, "the scheduler does not make progress"
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        for seq in [s for s in list(sched.running) + list(sched.waiting) if aborts.get(s.seq_id) == step]:
            sched.abort(seq)
            assert seq.finish_reason == "abort" and not seq.block_table
        if sched.has_unfinished():
            decoding = {s.seq_id for s in sched.running if s.num_uncomputed_tokens == 1}
            batch = sched.schedule()
            assert batch.total_tokens <= sched.max_num_batched_tokens
            assert 0 < len(batch) <= sched.max_num_seqs and len({s.seq_id for s in batch.seqs}) == len(batch)
            assert all(n >= 1 and s.status is SequenceStatus.RUNNING for s, n in zip(batch.seqs, batch.num_new_tokens))
            if sched.policy == "prefill_first":   # a step is all prompt work or all decodes, never both
                kinds = {s.seq_id in decoding for s in batch.seqs}
                assert len(kinds) == 1, "prefill_first mixed prompt work and decodes"
            check_state(sched)
            finished = sched.postprocess(batch, runner.run(batch))
            assert all(s.is_finished and not s.block_table for s in finished)
            check_state(sched)
            batches.append(batch)
        step += 1
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return batches


def request(prompt, **params) -> tuple[list[int], SamplingParams]:
    return list(prompt), SamplingParams(**params)


def make(sched: Scheduler, prompt, **params) -> Sequence:
    return Sequence(list(prompt), SamplingParams(**params), block_size=sched.block_size)


def assert_reference_outputs(sched: Scheduler, seqs: list[Sequence]) -> None:
    for s in seqs:
        tokens, reason, stop_reason = reference(s.prompt_token_ids, s.sampling_params, sched.eos_token_ids,
                                                sched.max_model_len)
        assert (s.completion_token_ids, s.finish_reason, s.stop_reason) == (tokens, reason, stop_reason), s
        assert s.num_tokens <= sched.max_model_len


# ---- construction -------------------------------------------------------------------------------------------------
GOOD = dict(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)


@pytest.mark.parametrize("bad, exc, words", [
    (dict(enable_chunked_prefill=False), ValueError, "without chunked prefill, max_num_batched_tokens"),
    (dict(max_num_seqs=300), ValueError, "must be >= max_num_seqs"),
    (dict(num_blocks=31), ValueError, "cannot hold one sequence of max_model_len"),
    (dict(block_size=0), ValueError, "block_size must be at least 1"),
    (dict(max_model_len=2.5), TypeError, "max_model_len must be an int"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(eos_token_id="</s>"), TypeError, "eos_token_id"),
    (dict(eos_token_id=[1, -2]), TypeError, "eos_token_id"),
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching"),
    (dict(policy="fifo"), ValueError, "policy"),
])
def test_constructor_validation(bad, exc, words):
    with pytest.raises(exc, match=words):
        Scheduler(**(GOOD | bad))


def test_constructor_accepts_and_normalizes():
    s = Scheduler(**GOOD, eos_token_id=[2, 7])
    assert s.eos_token_ids == frozenset({2, 7}) and s.block_manager.num_blocks == 64
    assert Scheduler(**GOOD, eos_token_id=3).eos_token_ids == frozenset({3})
    assert Scheduler(**GOOD).eos_token_ids == frozenset()
    assert Scheduler(**(GOOD | dict(max_num_batched_tokens=512)), enable_chunked_prefill=False)
    assert s.is_finished() and not s.has_unfinished()


def test_add_validation():
    s = Scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    with pytest.raises(ValueError, match="block_size"):
        s.add(Sequence([1, 2], block_size=8))
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        s.add(make(s, range(16)))
    with pytest.raises(ValueError, match="at least 1"):
        s.add(make(s, []))
    with pytest.raises(TypeError, match="Sequence"):
        s.add([1, 2, 3])
    seq = make(s, range(15))
    s.add(seq)
    with pytest.raises(ValueError, match="not a new request"):
        s.add(seq)


# ---- the mixed policy, step by step ---------------------------------------------------------------------------
def plan(batch: ScheduledBatch, seqs: list[Sequence]) -> list[tuple[int, int]]:
    return [(seqs.index(s), n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_mixed_policy_exact_steps():
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32)
    seqs = [make(sched, range(100 * i, 100 * i + n), max_tokens=3, ignore_eos=True) for i, n in enumerate([6, 9, 5])]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [
        [(0, 6), (1, 2)],            # a whole prompt, then a chunk of the next
        [(0, 1), (1, 7)],            # the decode first, then the rest of the chunked prompt
        [(0, 1), (1, 1), (2, 5)],    # two decodes and a new prompt in one step
        [(1, 1), (2, 1)],
        [(2, 1)],
    ]
    assert [b.sample_mask for b in batches[:2]] == [[True, False], [True, True]]
    assert [b.is_prefill for b in batches[:3]] == [[True, True], [False, True], [False, False, True]]
    assert batches[3].is_decode_only and not batches[2].is_decode_only
    assert_reference_outputs(sched, seqs)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=12,
                      enable_chunked_prefill=False)
    seqs = [make(sched, range(100 * i, 100 * i + n), max_tokens=2, ignore_eos=True) for i, n in enumerate([6, 9])]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [[(0, 6)], [(0, 1), (1, 9)], [(1, 1)]]


def test_prefill_first_policy_never_mixes():
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32,
                      policy="prefill_first")
    seqs = [make(sched, range(100 * i, 100 * i + n), max_tokens=3, ignore_eos=True) for i, n in enumerate([6, 9, 5])]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [
        [(0, 6), (1, 2)], [(1, 7), (2, 1)], [(2, 4)],   # prompt work only, while there is any
        [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]
    assert_reference_outputs(sched, seqs)


def test_max_num_seqs_limits_running():
    sched = Scheduler(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    seqs = [make(sched, [i, i + 1, i + 2], max_tokens=2, ignore_eos=True) for i in range(0, 40, 10)]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [[(0, 3), (1, 3)], [(0, 1), (1, 1)], [(2, 3), (3, 3)],
                                                [(2, 1), (3, 1)]]


def test_prefix_hits_at_admission_reduce_the_prompt_work():
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    first = make(sched, range(10), max_tokens=1, ignore_eos=True)
    second = make(sched, list(range(9)) + [77, 78], max_tokens=1, ignore_eos=True)
    batches = drive(sched, [(0, first), (1, second)])
    assert [plan(b, [first, second]) for b in batches] == [[(0, 10)], [(1, 3)]]
    assert second.num_cached_tokens == 8 and first.num_cached_tokens == 0
    assert sched.block_manager.prefix_cache_hits == 8
    assert_reference_outputs(sched, [first, second])


def test_prompts_arriving_together_with_a_shared_prefix_compute_it_once():
    "The second prompt's first uncached block is being computed by the first: it waits one step and hits the cache."
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    first = make(sched, range(10), max_tokens=2, ignore_eos=True)
    second = make(sched, list(range(9)) + [77, 78], max_tokens=2, ignore_eos=True)
    other = make(sched, [50, 51, 52], max_tokens=2, ignore_eos=True)
    batches = drive(sched, [(0, first), (0, second), (0, other)])
    assert plan(batches[0], [first, second, other]) == [(0, 10)]          # second (and other, behind it) wait
    assert plan(batches[1], [first, second, other]) == [(0, 1), (1, 3), (2, 3)]
    assert second.num_cached_tokens == 8 and sched.block_manager.prefix_cache_hits == 8
    assert_reference_outputs(sched, [first, second, other])


# ---- preemption -------------------------------------------------------------------------------------------------
def test_preemption_victim_is_the_most_recently_admitted_and_nothing_is_admitted_that_step():
    sched = Scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    a, b, c = (make(sched, range(100 * i, 100 * i + 8), max_tokens=8, ignore_eos=True) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    runner = FakeRunner(sched)
    batch = sched.schedule()                     # 3 x 2 blocks = 6 of 8
    assert batch.seqs == [a, b, c]
    sched.postprocess(batch, runner.run(batch))  # each now has 9 tokens: the next step needs a block each
    late = make(sched, [1, 2, 3], max_tokens=1)
    sched.add(late)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and [s.seq_id for s in batch.preempted] == [c.seq_id]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.block_table == []
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [c, late]      # back at the front; and nobody admitted in this step
    sched.postprocess(batch, runner.run(batch))
    check_state(sched)


def test_small_cache_preempts_and_outputs_match_unconstrained_runs():
    for caching in (True, False):
        for policy in POLICIES:
            sched = Scheduler(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                              max_model_len=40, enable_prefix_caching=caching, policy=policy)
            seqs = [make(sched, [i % 7 + 1] * 3 + list(range(10 * i, 10 * i + 4)), max_tokens=24, ignore_eos=True)
                    for i in range(4)]
            drive(sched, [(0, s) for s in seqs])
            assert sched.num_preemptions > 0 and sum(s.num_preemptions for s in seqs) == sched.num_preemptions
            assert_reference_outputs(sched, seqs)
            assert all(len(s.completion_token_ids) == 24 for s in seqs)


def test_a_lone_sequence_that_cannot_grow_raises_instead_of_hanging():
    sched = Scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)
    seq = make(sched, range(4), max_tokens=8, ignore_eos=True)
    sched.add(seq)
    batch = sched.schedule()
    sched.postprocess(batch, [5])
    leak = Sequence(range(100, 112), block_size=4)   # blocks taken behind the scheduler's back
    sched.block_manager.allocate_prefix(leak)
    sched.block_manager.allocate(leak, 12)
    with pytest.raises(RuntimeError, match="no other sequence left to preempt"):
        sched.schedule()


# ---- stop rules -------------------------------------------------------------------------------------------------
def test_check_stop_rules_and_order():
    def stop(token, max_model_len=100, eos=frozenset({0}), **params):
        s = Sequence([1, 2, 3], SamplingParams(**params))
        s.append_token(token)
        return check_stop(s, token, eos, max_model_len)

    assert stop(0) == ("stop", None)
    assert stop(0, ignore_eos=True) == (None, None)
    assert stop(9, eos=frozenset({9, 0})) == ("stop", None)
    assert stop(7, stop_token_ids=[7]) == ("stop", 7)
    assert stop(7, stop_token_ids=[7], ignore_eos=True) == ("stop", 7)
    assert stop(5, max_tokens=1) == ("length", None)
    assert stop(5, max_tokens=2) == (None, None)
    assert stop(0, max_tokens=1) == ("stop", None)            # a token stop wins over the length limit
    assert stop(5, max_tokens=None, max_model_len=4) == ("length", None)
    assert stop(5, max_tokens=None, max_model_len=5) == (None, None)


@pytest.mark.parametrize("eos", [None, 3, [3, 11]])
def test_stop_rules_through_the_scheduler(eos):
    sched = Scheduler(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=24,
                      eos_token_id=eos)
    seqs = []
    for i in range(24):
        prompt = [i, i + 1, (7 * i) % VOCAB]
        params = [dict(max_tokens=5), dict(max_tokens=None), dict(max_tokens=30, ignore_eos=True),
                  dict(max_tokens=None, stop_token_ids=[i % VOCAB, (3 * i) % VOCAB])][i % 4]
        seqs.append(make(sched, prompt, **params))
    drive(sched, [(i // 4, s) for i, s in enumerate(seqs)])
    assert_reference_outputs(sched, seqs)
    reasons = Counter(s.finish_reason for s in seqs)
    assert reasons["length"] > 0 and all(s.num_tokens <= 24 for s in seqs)


# ---- finishing from outside -------------------------------------------------------------------------------------
def test_finish_abort_and_abort_all():
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32)
    a, b, c = (make(sched, range(10 * i, 10 * i + 5), max_tokens=8) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and list(sched.waiting) == [c]
    sched.finish(a, "stop", stop_reason="\n\n")      # the engine's stop strings
    assert (a.status, a.finish_reason, a.stop_reason, a.block_table) == (SequenceStatus.FINISHED, "stop", "\n\n", [])
    finished = sched.postprocess(batch, [1, 2])      # a finished while its step ran: skipped
    assert finished == [] and a.num_tokens == 5 and b.num_tokens == 6
    sched.finish(a, "stop")                          # finishing twice is a no-op
    with pytest.raises(ValueError, match="finish_reason"):
        sched.finish(b, "done")
    with pytest.raises(ValueError, match="not in this scheduler"):
        sched.finish(make(sched, [1, 2]), "abort")
    with pytest.raises(ValueError, match="sampled token ids"):
        sched.postprocess(sched.schedule(), [])
    aborted = sched.abort_all()
    assert {s.seq_id for s in aborted} == {b.seq_id, c.seq_id}
    assert all(s.finish_reason == "abort" for s in aborted) and sched.is_finished()
    assert sched.block_manager.num_free_blocks == 16
    sched.block_manager.reset_prefix_cache()
    assert sched.block_manager.hash_to_block_id == {}
    check_state(sched)


# ---- property test: random request streams -------------------------------------------------------------------
@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    min_blocks = math.ceil(max_model_len / block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks + 10))
    max_num_seqs = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    lowest = max(max_num_seqs, 1 if chunked else max_model_len)
    budget = draw(st.integers(lowest, lowest + 40))
    config = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=budget, max_model_len=max_model_len,
                  eos_token_id=draw(st.sampled_from([None, 0, [0, 1]])), enable_chunked_prefill=chunked,
                  enable_prefix_caching=draw(st.booleans()), policy=draw(st.sampled_from(POLICIES)))
    bases = [draw(st.lists(st.integers(2, VOCAB - 1), max_size=max_model_len)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        base = draw(st.sampled_from(bases))
        prompt = base[:draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
        prompt = prompt[:max_model_len - 1] or [draw(st.integers(0, VOCAB - 1))]
        params = dict(max_tokens=draw(st.one_of(st.none(), st.integers(1, 24))), ignore_eos=draw(st.booleans()),
                      stop_token_ids=draw(st.lists(st.integers(2, VOCAB - 1), max_size=1)))
        requests.append((draw(st.integers(0, 12)), prompt, params, draw(st.one_of(st.none(), st.integers(0, 40)))))
    abort_some = draw(st.booleans())
    return config, requests, abort_some


@settings(max_examples=250, deadline=None)
@given(workloads())
def test_random_request_streams(case):
    config, requests, abort_some = case
    sched = Scheduler(**config)
    arrivals, aborts = [], {}
    for arrival, prompt, params, abort_at in requests:
        seq = make(sched, prompt, **params)
        arrivals.append((arrival, seq))
        if abort_some and abort_at is not None:
            aborts[seq.seq_id] = arrival + abort_at
    drive(sched, arrivals, aborts)
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix-cache hits: {sched.block_manager.prefix_cache_hits > 0}")
    for _, seq in arrivals:
        event(f"finish: {seq.finish_reason}, stop_reason set: {seq.stop_reason is not None}")
        assert seq.is_finished and seq.num_tokens <= sched.max_model_len
        tokens, reason, stop_reason = reference(seq.prompt_token_ids, seq.sampling_params, sched.eos_token_ids,
                                                sched.max_model_len)
        if seq.finish_reason == "abort":
            assert seq.completion_token_ids == tokens[:len(seq.completion_token_ids)]
        else:
            assert (seq.completion_token_ids, seq.finish_reason, seq.stop_reason) == (tokens, reason, stop_reason)


@st.composite
def tight_workloads(draw):
    "Caches just big enough for one long sequence, many requests sharing prefixes: lots of preemption."
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(12, 40))
    num_blocks = math.ceil(max_model_len / block_size) + draw(st.integers(0, 3))
    shared = draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=10))
    prompts = [(shared + draw(st.lists(st.integers(0, VOCAB - 1), max_size=4)))[:max_model_len - 1]
               for _ in range(draw(st.integers(2, 6)))]
    return dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=draw(st.integers(2, 6)),
                max_num_batched_tokens=draw(st.integers(6, 48)), max_model_len=max_model_len,
                enable_prefix_caching=draw(st.booleans()), policy=draw(st.sampled_from(POLICIES))), prompts


@settings(max_examples=200, deadline=None)
@given(tight_workloads())
def test_tight_caches_preempt_without_changing_outputs(case):
    config, prompts = case
    sched = Scheduler(**config)
    seqs = [make(sched, p, max_tokens=None, ignore_eos=True) for p in prompts]   # all grow to max_model_len
    drive(sched, [(0, s) for s in seqs])
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix-cache hits: {sched.block_manager.prefix_cache_hits > 0}")
    assert_reference_outputs(sched, seqs)
    assert all(s.num_tokens == sched.max_model_len for s in seqs)
