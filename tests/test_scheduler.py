"""Tests of minivllm.engine.scheduler, driven by a deterministic fake model.

The fake model's next token is a pure function of the sequence's tokens so far, so whatever the scheduler does
(batching, chunked prefill, preemption, prefix caching), every request must produce exactly the tokens it would
produce running alone. A fake KV cache checks that every step reads the right tokens at the right positions
through the block tables, and never writes into a shared or cached block.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter

import numpy as np
import pytest
import xxhash
from hypothesis import event, given, settings
from hypothesis import strategies as st

import minivllm.engine.block_manager as bm_module
from minivllm.engine.lookahead import plan_lookahead
from minivllm.engine.scheduler import POLICIES, Scheduler, StepPlan, check_stop
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
        out = tokens[len(prompt) :]
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

    def run(self, batch: StepPlan) -> list[int]:
        out = []
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.is_sampled):
            if seq.is_finished:  # finished (aborted, or by its last step) after this step was planned: token dropped
                out.append(0)
                continue
            start = seq.num_computed_tokens
            assert len(seq.block_table) * self.bs >= start + n
            self.check_context(seq, start)  # cached prefix and earlier steps are intact
            for pos in range(start, start + n):
                b, off = self.slot(seq, pos)
                block = self.bm.blocks[b]
                # a shared or cached block is written only by the step that registered it (a prompt admitted with
                # it), with the very tokens it is registered for
                assert (block.ref_count == 1 and block.hash == -1) or block.token_ids[off] == seq.token_ids[pos], (
                    "write into a shared or cached block"
                )
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


def check_decode_plan(plan: StepPlan) -> None:
    "A decode step: StepPlan.of works out the same flags StepPlan.decode sets."
    general = StepPlan.of(plan.seqs, [1] * len(plan))
    assert all(s.num_prompt_tokens <= s.num_computed_tokens == s.num_tokens - 1 for s in plan.seqs if not s.is_finished)
    assert (plan.num_new_tokens, plan.is_sampled, plan.is_prefill, plan.sampled_seqs, plan.num_prefill_tokens) == (
        [1] * len(plan),
        [True] * len(plan),
        [False] * len(plan),
        plan.seqs,
        0,
    )
    if not any(s.is_finished for s in plan.seqs):
        assert (general.is_sampled, general.is_prefill, general.sampled_seqs, general.num_prefill_tokens) == (
            plan.is_sampled,
            plan.is_prefill,
            plan.sampled_seqs,
            plan.num_prefill_tokens,
        )


def check_ahead(sched: Scheduler, prev: StepPlan, ahead: StepPlan | None, free_before: int) -> None:
    "What plan_lookahead promises about the decode step it planned after `prev` (before `prev` is postprocessed)."
    if ahead is None:
        assert sched.block_manager.num_free_blocks == free_before, "a refused lookahead reserved blocks"
        return
    assert prev.is_decode_only and len(prev) == len(sched.running) and sched.policy == "mixed"
    by_length = {
        s.seq_id for s in prev.seqs if s.num_tokens + 1 >= min(sched.max_model_len, s.max_num_tokens)
    }  # prev's token ends them
    rows = [i for i, s in enumerate(prev.seqs) if s.seq_id not in by_length]
    assert ahead.ahead_rows == rows and ahead.seqs == [prev.seqs[i] for i in rows]
    assert (ahead.num_new_tokens, ahead.is_sampled, ahead.is_prefill, ahead.sampled_seqs, ahead.num_prefill_tokens) == (
        [1] * len(ahead),
        [True] * len(ahead),
        [False] * len(ahead),
        ahead.seqs,
        0,
    )
    assert ahead.preempted == [] and ahead.is_decode_only
    for s in ahead.seqs:  # a block for the token prev samples, which the ahead step computes
        assert len(s.block_table) * sched.block_size >= s.num_tokens + 1


def drive(
    sched: Scheduler,
    arrivals: list[tuple[int, Sequence]],
    aborts: dict[int, int] | None = None,
    max_steps: int = 20_000,
    lookahead: bool = False,
    runner: FakeRunner | None = None,
) -> list[StepPlan]:
    """Run requests (arrival step, Sequence) to completion, checking everything after every step. With `lookahead`,
    as the engine's asynchronous scheduling: the decode step after each step is planned before that step's tokens
    are applied, and run next instead of a scheduled one. `runner`: the fake KV cache of earlier steps, if any."""
    runner, pending, batches, step = runner or FakeRunner(sched), sorted(arrivals, key=lambda a: a[0]), [], 0
    aborts, ahead = aborts or {}, None
    while pending or sched.has_unfinished() or ahead is not None:
        assert step < max_steps, "the scheduler does not make progress"
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        for seq in [s for s in list(sched.running) + list(sched.waiting) if aborts.get(s.seq_id) == step]:
            sched.abort(seq)
            assert seq.finish_reason == "abort" and not seq.block_table
        if ahead is not None:
            batch, ahead = ahead, None
            assert all(
                s.status is (SequenceStatus.FINISHED if s.is_finished else SequenceStatus.RUNNING) for s in batch.seqs
            )
            check_decode_plan(batch)  # now that the step before it is applied, it is a decode step
            check_state(sched)
        elif sched.has_unfinished():
            decoding = {s.seq_id for s in sched.running if s.num_uncomputed_tokens == 1}
            batch = sched.schedule()
            assert batch.total_tokens <= sched.max_num_batched_tokens
            assert 0 < len(batch) <= sched.max_num_seqs and len({s.seq_id for s in batch.seqs}) == len(batch)
            assert all(n >= 1 and s.status is SequenceStatus.RUNNING for s, n in zip(batch.seqs, batch.num_new_tokens))
            if sched.policy == "prefill_first":  # a step is all prompt work or all decodes, never both
                kinds = {s.seq_id in decoding for s in batch.seqs}
                assert len(kinds) == 1, "prefill_first mixed prompt work and decodes"
            if not any(batch.is_prefill):
                check_decode_plan(batch)
            check_state(sched)
        else:
            step += 1
            continue
        if lookahead:
            free_before = sched.block_manager.num_free_blocks
            ahead = plan_lookahead(sched, batch)
            check_ahead(sched, batch, ahead, free_before)
            check_state(sched)
        left_out = [] if ahead is None else [s for s in batch.seqs if s not in ahead.seqs]
        finished = sched.postprocess(batch, runner.run(batch))
        assert all(s.is_finished and not s.block_table for s in finished)
        assert all(s.is_finished for s in left_out), "a sequence left out of the step planned ahead did not finish"
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
        tokens, reason, stop_reason = reference(
            s.prompt_token_ids, s.sampling_params, sched.eos_token_ids, sched.max_model_len
        )
        assert (s.completion_token_ids, s.finish_reason, s.stop_reason) == (tokens, reason, stop_reason), s
        assert s.num_tokens <= sched.max_model_len


# ---- construction -------------------------------------------------------------------------------------------------
GOOD = dict(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)


def test_constructor_accepts_and_normalizes():
    s = Scheduler(**GOOD, eos_token_id=[2, 7])
    assert s.eos_token_ids == frozenset({2, 7}) and s.block_manager.num_blocks == 64
    assert Scheduler(**GOOD, eos_token_id=3).eos_token_ids == frozenset({3})
    assert Scheduler(**GOOD).eos_token_ids == frozenset()
    assert Scheduler(**(GOOD | dict(max_num_batched_tokens=512)), enable_chunked_prefill=False)
    assert not s.has_unfinished()


# ---- the mixed policy, step by step ---------------------------------------------------------------------------
def plan(batch: StepPlan, seqs: list[Sequence]) -> list[tuple[int, int]]:
    return [(seqs.index(s), n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_mixed_policy_exact_steps():
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32)
    seqs = [make(sched, range(100 * i, 100 * i + n), max_tokens=3, ignore_eos=True) for i, n in enumerate([6, 9, 5])]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [
        [(0, 6), (1, 2)],  # a whole prompt, then a chunk of the next
        [(0, 1), (1, 7)],  # the decode first, then the rest of the chunked prompt
        [(0, 1), (1, 1), (2, 5)],  # two decodes and a new prompt in one step
        [(1, 1), (2, 1)],
        [(2, 1)],
    ]
    assert [b.is_sampled for b in batches[:2]] == [[True, False], [True, True]]
    assert [b.is_prefill for b in batches[:3]] == [[True, True], [False, True], [False, False, True]]
    assert batches[3].is_decode_only and not batches[2].is_decode_only
    assert_reference_outputs(sched, seqs)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = Scheduler(
        num_blocks=16,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        max_model_len=12,
        enable_chunked_prefill=False,
    )
    seqs = [make(sched, range(100 * i, 100 * i + n), max_tokens=2, ignore_eos=True) for i, n in enumerate([6, 9])]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [[(0, 6)], [(0, 1), (1, 9)], [(1, 1)]]


def test_prefill_first_policy_never_mixes():
    sched = Scheduler(
        num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32, policy="prefill_first"
    )
    seqs = [make(sched, range(100 * i, 100 * i + n), max_tokens=3, ignore_eos=True) for i, n in enumerate([6, 9, 5])]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [
        [(0, 6), (1, 2)],
        [(1, 7), (2, 1)],
        [(2, 4)],  # prompt work only, while there is any
        [(0, 1), (1, 1), (2, 1)],
        [(0, 1), (1, 1), (2, 1)],
    ]
    assert_reference_outputs(sched, seqs)


def test_max_num_seqs_limits_running():
    sched = Scheduler(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    seqs = [make(sched, [i, i + 1, i + 2], max_tokens=2, ignore_eos=True) for i in range(0, 40, 10)]
    batches = drive(sched, [(0, s) for s in seqs])
    assert [plan(b, seqs) for b in batches] == [[(0, 3), (1, 3)], [(0, 1), (1, 1)], [(2, 3), (3, 3)], [(2, 1), (3, 1)]]


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
    "The first prompt registers the blocks it computes as it is admitted: the second shares them in the same step."
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    first = make(sched, range(10), max_tokens=2, ignore_eos=True)
    second = make(sched, list(range(9)) + [77, 78], max_tokens=2, ignore_eos=True)
    other = make(sched, [50, 51, 52], max_tokens=2, ignore_eos=True)
    batches = drive(sched, [(0, first), (0, second), (0, other)])
    assert plan(batches[0], [first, second, other]) == [(0, 10), (1, 3), (2, 3)]  # one step: second hits 8 tokens
    assert second.block_table[:2] == first.block_table[:2]
    assert second.num_cached_tokens == 8 and sched.block_manager.prefix_cache_hits == 8
    assert_reference_outputs(sched, [first, second, other])


# ---- preemption -------------------------------------------------------------------------------------------------
def test_preemption_victim_is_the_most_recently_admitted_and_nothing_is_admitted_that_step():
    sched = Scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    a, b, c = (make(sched, range(100 * i, 100 * i + 8), max_tokens=8, ignore_eos=True) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    runner = FakeRunner(sched)
    batch = sched.schedule()  # 3 x 2 blocks = 6 of 8
    assert batch.seqs == [a, b, c]
    sched.postprocess(batch, runner.run(batch))  # each now has 9 tokens: the next step needs a block each
    late = make(sched, [1, 2, 3], max_tokens=1)
    sched.add(late)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and [s.seq_id for s in batch.preempted] == [c.seq_id]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.block_table == []
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [c, late]  # back at the front; and nobody admitted in this step
    sched.postprocess(batch, runner.run(batch))
    check_state(sched)


def test_small_cache_preempts_and_outputs_match_unconstrained_runs():
    for caching in (True, False):
        for policy in POLICIES:
            sched = Scheduler(
                num_blocks=10,
                block_size=4,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                max_model_len=40,
                enable_prefix_caching=caching,
                policy=policy,
            )
            seqs = [
                make(sched, [i % 7 + 1] * 3 + list(range(10 * i, 10 * i + 4)), max_tokens=24, ignore_eos=True)
                for i in range(4)
            ]
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
    leak = Sequence(range(100, 112), block_size=4)  # blocks taken behind the scheduler's back
    sched.block_manager.allocate(leak, 12, sched.block_manager.match_prefix(leak))
    with pytest.raises(RuntimeError, match="no other sequence to preempt"):
        sched.schedule()


def test_block_hashes_survive_preemption_and_are_not_recomputed(monkeypatch):
    calls, hash_bytes = [], bm_module.hash_block_bytes

    def counting(data, prefix_hash=-1):
        calls.append((tuple(array("q", data)), prefix_hash))
        return hash_bytes(data, prefix_hash)

    def compute_block_hash(token_ids, prefix_hash=-1):  # the definition, without counting
        return hash_bytes(array("q", token_ids).tobytes(), prefix_hash)

    monkeypatch.setattr(bm_module, "hash_block_bytes", counting)
    sched = Scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    a, b, c = (make(sched, range(100 * i, 100 * i + 8), max_tokens=8, ignore_eos=True) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    runner = FakeRunner(sched)
    batch = sched.schedule()
    sched.postprocess(batch, runner.run(batch))  # each has 8 computed tokens: 2 full blocks, hashed once each
    assert len(calls) == 6
    hashes = list(c.block_hashes)
    assert hashes == [compute_block_hash(c.block(0)), compute_block_hash(c.block(1), compute_block_hash(c.block(0)))]
    batch = sched.schedule()
    assert [s.seq_id for s in batch.preempted] == [c.seq_id]
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.block_hashes == hashes  # kept
    sched.postprocess(batch, runner.run(batch))
    assert len(calls) == 6  # no block filled up: nothing hashed
    seqs, n = [a, b, c], 0
    while c.status is not SequenceStatus.RUNNING:  # a and b finish, then c is admitted again
        batch = sched.schedule()
        sched.postprocess(batch, runner.run(batch))
        n += 1
        assert n < 50
    assert c.block_hashes[:2] == hashes
    assert not any(tokens in (tuple(c.block(0)), tuple(c.block(1))) for tokens, _ in calls[6:])  # not rehashed
    drive(sched, [], runner=runner)
    assert_reference_outputs(sched, seqs)
    for s in seqs:  # every sequence's hashes: the chained hashes of its full blocks
        expect = []
        for i in range(len(s.block_hashes)):
            expect.append(compute_block_hash(s.block(i), expect[-1] if expect else -1))
        assert s.block_hashes == expect and len(s.block_hashes) <= s.num_full_blocks
    counts = Counter(calls)  # each full block hashed once, however often it was matched, committed or recomputed
    assert all(
        counts[tuple(s.block(i)), s.block_hashes[i - 1] if i else -1] == 1
        for s in seqs
        for i in range(len(s.block_hashes))
    )
    assert len(calls) == sum(len(s.block_hashes) for s in seqs)


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
    assert stop(0, max_tokens=1) == ("stop", None)  # a token stop wins over the length limit
    assert stop(5, max_tokens=None, max_model_len=4) == ("length", None)
    assert stop(5, max_tokens=None, max_model_len=5) == (None, None)


@pytest.mark.parametrize("eos", [None, 3, [3, 11]])
def test_stop_rules_through_the_scheduler(eos):
    sched = Scheduler(
        num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=24, eos_token_id=eos
    )
    seqs = []
    for i in range(24):
        prompt = [i, i + 1, (7 * i) % VOCAB]
        params = [
            dict(max_tokens=5),
            dict(max_tokens=None),
            dict(max_tokens=30, ignore_eos=True),
            dict(max_tokens=None, stop_token_ids=[i % VOCAB, (3 * i) % VOCAB]),
        ][i % 4]
        seqs.append(make(sched, prompt, **params))
    drive(sched, [(i // 4, s) for i, s in enumerate(seqs)])
    assert_reference_outputs(sched, seqs)
    reasons = Counter(s.finish_reason for s in seqs)
    assert reasons["length"] > 0 and all(s.num_tokens <= 24 for s in seqs)


# ---- finishing from outside -------------------------------------------------------------------------------------
def test_finish_and_abort():
    sched = Scheduler(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32)
    a, b, c = (make(sched, range(10 * i, 10 * i + 5), max_tokens=8) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and list(sched.waiting) == [c]
    sched.finish(a, "stop", stop_reason="\n\n")  # the engine's stop strings
    assert (a.status, a.finish_reason, a.stop_reason, a.block_table) == (SequenceStatus.FINISHED, "stop", "\n\n", [])
    finished = sched.postprocess(batch, [1, 2])  # a finished while its step ran: skipped
    assert finished == [] and a.num_tokens == 5 and b.num_tokens == 6
    sched.finish(a, "stop")  # finishing twice is a no-op
    assert (a.finish_reason, a.stop_reason, sched.num_finished) == ("stop", "\n\n", 1)
    aborted = list(sched.running) + list(sched.waiting)
    for s in aborted:  # abort everything (one running, one waiting)
        sched.abort(s)
    assert {s.seq_id for s in aborted} == {b.seq_id, c.seq_id} and sched.num_finished == 3
    assert all(s.finish_reason == "abort" for s in aborted) and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16
    sched.block_manager.reset_prefix_cache()
    assert sched.block_manager.hash_to_block_id == {}
    check_state(sched)


# ---- StepPlan -----------------------------------------------------------------------------------------------------
@st.composite
def decode_states(draw):
    "Sequences that each computed all their tokens but the last, a sampled one: the state a decode step starts from."
    seqs = []
    for _ in range(draw(st.integers(0, 8))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        seq = Sequence(prompt, block_size=draw(st.sampled_from([1, 2, 4, 16])))
        for t in draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)):
            seq.append_token(t)
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    return seqs


@settings(max_examples=200, deadline=None)
@given(decode_states())
def test_step_plan_of_and_decode_agree_on_a_decode_step(seqs):
    general, decode = StepPlan.of(seqs, [1] * len(seqs)), StepPlan.decode(seqs)
    for plan in (general, decode):
        assert plan.seqs == seqs and plan.num_new_tokens == [1] * len(seqs) and len(plan) == len(seqs)
        assert plan.total_tokens == len(seqs) and plan.is_decode_only == bool(seqs)
        assert plan.preempted == [] and plan.ahead_rows is None
    assert (general.is_sampled, general.is_prefill, general.sampled_seqs, general.num_prefill_tokens) == (
        decode.is_sampled,
        decode.is_prefill,
        decode.sampled_seqs,
        decode.num_prefill_tokens,
    )
    assert decode.is_sampled == [True] * len(seqs) and decode.is_prefill == [False] * len(seqs)
    assert decode.sampled_seqs == seqs
    assert StepPlan.decode(seqs, ahead_rows=list(range(len(seqs)))).ahead_rows == list(range(len(seqs)))


def test_step_plan_of_tells_a_last_prompt_token_from_a_decode():
    done = Sequence([1, 2, 3], block_size=4)
    done.num_computed_tokens = 2  # a chunked prompt's last token: prefill, sampled
    decoding = Sequence([1, 2, 3], block_size=4)
    decoding.append_token(9)
    decoding.num_computed_tokens = 3
    chunk = Sequence([5, 6, 7, 8, 9], block_size=4)  # a chunk that stops short of the end: not sampled
    plan = StepPlan.of([done, decoding, chunk], [1, 1, 2], preempted=[Sequence([4])])
    assert plan.is_sampled == [True, True, False] and plan.is_prefill == [True, False, True]
    assert plan.sampled_seqs == [done, decoding] and plan.num_prefill_tokens == 3 and len(plan.preempted) == 1
    assert not plan.is_decode_only and plan.total_tokens == 4
    assert StepPlan.of([done, decoding], [1, 1]).is_decode_only  # one token each, though one is a prompt's
    assert not StepPlan.of([], []).is_decode_only


# ---- planning the next decode step ahead ---------------------------------------------------------------------------
def lookahead_scheduler(max_num_seqs: int = 3):
    "Three sequences right after their prompts: a (8 tokens in 2 blocks), b (6 tokens, max_tokens 2), c (3 tokens)."
    sched = Scheduler(
        num_blocks=16, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=32, max_model_len=32
    )
    a = make(sched, range(100, 107), max_tokens=10, ignore_eos=True)
    b = make(sched, range(200, 205), max_tokens=2, ignore_eos=True)
    c = make(sched, range(300, 302), max_tokens=10, ignore_eos=True)
    for s in (a, b, c):
        sched.add(s)
    runner = FakeRunner(sched)
    prefill = sched.schedule()
    free = sched.block_manager.num_free_blocks
    assert plan_lookahead(sched, prefill) is None  # not a decode step: nothing planned
    assert sched.block_manager.num_free_blocks == free
    sched.postprocess(prefill, runner.run(prefill))
    return sched, runner, a, b, c


def test_plan_lookahead_plans_the_next_decode_of_the_kept_sequences():
    sched, runner, a, b, c = lookahead_scheduler()
    decode = sched.schedule()
    assert decode.seqs == [a, b, c] and decode.is_decode_only
    free, tables = sched.block_manager.num_free_blocks, {s.seq_id: list(s.block_table) for s in (a, b, c)}
    ahead = plan_lookahead(sched, decode)
    assert ahead.seqs == [a, c]  # b: `decode` samples its last token (max_tokens): left out
    assert ahead.ahead_rows == [0, 2]  # a's and c's rows in `decode`
    assert (ahead.num_new_tokens, ahead.is_sampled, ahead.is_prefill, ahead.sampled_seqs, ahead.num_prefill_tokens) == (
        [1, 1],
        [True, True],
        [False, False],
        [a, c],
        0,
    )
    # a has 8 tokens in 2 full blocks: the token `decode` samples (position 8) opens a third, reserved now
    assert a.block_table[:2] == tables[a.seq_id] and len(a.block_table) == 3
    assert c.block_table == tables[c.seq_id] and b.block_table == tables[b.seq_id]  # c's block has room
    assert sched.block_manager.num_free_blocks == free - 1
    check_state(sched)
    finished = sched.postprocess(decode, runner.run(decode))
    assert finished == [b] and b.finish_reason == "length"
    assert [s.num_uncomputed_tokens for s in (a, c)] == [1, 1]


def test_plan_lookahead_runs_like_the_scheduled_step():
    "The step planned ahead is the one the scheduler would have made, on the same blocks; outputs are unchanged."
    sched, runner, a, b, c = lookahead_scheduler()
    decode = sched.schedule()
    ahead = plan_lookahead(sched, decode)
    sched.postprocess(decode, runner.run(decode))
    tables, free = {s.seq_id: list(s.block_table) for s in (a, c)}, sched.block_manager.num_free_blocks
    scheduled = sched.schedule()  # what the engine would run without planning ahead
    assert scheduled.seqs == ahead.seqs and scheduled.num_new_tokens == ahead.num_new_tokens
    assert (scheduled.is_sampled, scheduled.is_prefill) == (ahead.is_sampled, ahead.is_prefill)
    assert sched.block_manager.num_free_blocks == free and all(s.block_table == tables[s.seq_id] for s in (a, c))
    sched.postprocess(ahead, runner.run(ahead))
    drive(sched, [], lookahead=True, runner=runner)
    assert_reference_outputs(sched, [a, b, c])


def test_plan_lookahead_refuses_when_it_cannot_plan_safely():
    # a sequence of the step left while it ran: the step is no longer a decode of every running sequence
    sched, runner, a, b, c = lookahead_scheduler()
    decode = sched.schedule()
    sched.finish(c, "abort")
    free = sched.block_manager.num_free_blocks
    assert plan_lookahead(sched, decode) is None and sched.block_manager.num_free_blocks == free
    sched.postprocess(decode, runner.run(decode))  # b finishes by length: a place for a prompt
    sched.add(make(sched, [1, 2, 3], max_tokens=2))
    assert plan_lookahead(sched, sched.schedule()) is None  # that step admitted the prompt: not decode-only
    # a prompt waits while there is room for it: the next step must be scheduled to admit it
    for max_num_seqs, planned in [(4, False), (3, True)]:  # (with no room, waiting prompts do not matter)
        sched, runner, a, b, c = lookahead_scheduler(max_num_seqs)
        decode = sched.schedule()
        sched.add(make(sched, [4, 5], max_tokens=2))
        assert (plan_lookahead(sched, decode) is not None) == planned
    # blocks would run out: both sequences' next tokens open a block, none is free
    sched = Scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)
    seqs = [make(sched, range(10 * i, 10 * i + 7), max_tokens=5, ignore_eos=True) for i in range(2)]
    for s in seqs:
        sched.add(s)
    runner = FakeRunner(sched)
    step = sched.schedule()
    sched.postprocess(step, runner.run(step))  # 8 tokens each, 7 computed in 2 blocks: all 4 blocks used
    decode = sched.schedule()
    assert decode.is_decode_only and sched.block_manager.num_free_blocks == 0
    assert plan_lookahead(sched, decode) is None
    sched.postprocess(decode, runner.run(decode))
    # every sequence of the step finishes by length: nothing to plan
    sched, runner, a, b, c = lookahead_scheduler()
    decode = sched.schedule()
    sched.finish(a, "abort")
    sched.finish(c, "abort")
    assert plan_lookahead(sched, StepPlan.decode([b])) is None
    # the prefill_first policy never plans ahead
    sched = Scheduler(
        num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32, policy="prefill_first"
    )
    s = make(sched, range(5), max_tokens=5, ignore_eos=True)
    sched.add(s)
    step = sched.schedule()
    sched.postprocess(step, FakeRunner(sched).run(step))
    decode = sched.schedule()
    assert decode.is_decode_only and plan_lookahead(sched, decode) is None


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
    config = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        eos_token_id=draw(st.sampled_from([None, 0, [0, 1]])),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(POLICIES)),
    )
    bases = [draw(st.lists(st.integers(2, VOCAB - 1), max_size=max_model_len)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        base = draw(st.sampled_from(bases))
        prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
        prompt = prompt[: max_model_len - 1] or [draw(st.integers(0, VOCAB - 1))]
        params = dict(
            max_tokens=draw(st.one_of(st.none(), st.integers(1, 24))),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(2, VOCAB - 1), max_size=1)),
        )
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
        tokens, reason, stop_reason = reference(
            seq.prompt_token_ids, seq.sampling_params, sched.eos_token_ids, sched.max_model_len
        )
        if seq.finish_reason == "abort":
            assert seq.completion_token_ids == tokens[: len(seq.completion_token_ids)]
        else:
            assert (seq.completion_token_ids, seq.finish_reason, seq.stop_reason) == (tokens, reason, stop_reason)


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_request_streams_planned_ahead(case):
    "As above, with every decode step that can be planned ahead planned ahead (asynchronous scheduling)."
    config, requests, abort_some = case
    sched = Scheduler(**config)
    arrivals, aborts = [], {}
    for arrival, prompt, params, abort_at in requests:
        seq = make(sched, prompt, **params)
        arrivals.append((arrival, seq))
        if abort_some and abort_at is not None:
            aborts[seq.seq_id] = arrival + abort_at
    batches = drive(sched, arrivals, aborts, lookahead=True)
    event(f"planned ahead: {any(b.ahead_rows is not None for b in batches)}")
    for _, seq in arrivals:
        assert seq.is_finished and seq.num_tokens <= sched.max_model_len
        tokens, reason, stop_reason = reference(
            seq.prompt_token_ids, seq.sampling_params, sched.eos_token_ids, sched.max_model_len
        )
        if seq.finish_reason == "abort":
            assert seq.completion_token_ids == tokens[: len(seq.completion_token_ids)]
        else:
            assert (seq.completion_token_ids, seq.finish_reason, seq.stop_reason) == (tokens, reason, stop_reason)


@st.composite
def tight_workloads(draw):
    "Caches just big enough for one long sequence, many requests sharing prefixes: lots of preemption."
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(12, 40))
    num_blocks = math.ceil(max_model_len / block_size) + draw(st.integers(0, 3))
    shared = draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=10))
    prompts = [
        (shared + draw(st.lists(st.integers(0, VOCAB - 1), max_size=4)))[: max_model_len - 1]
        for _ in range(draw(st.integers(2, 6)))
    ]
    return dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(2, 6)),
        max_num_batched_tokens=draw(st.integers(6, 48)),
        max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(POLICIES)),
    ), prompts


@settings(max_examples=200, deadline=None)
@given(tight_workloads())
def test_tight_caches_preempt_without_changing_outputs(case):
    config, prompts = case
    sched = Scheduler(**config)
    seqs = [make(sched, p, max_tokens=None, ignore_eos=True) for p in prompts]  # all grow to max_model_len
    drive(sched, [(0, s) for s in seqs])
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix-cache hits: {sched.block_manager.prefix_cache_hits > 0}")
    assert_reference_outputs(sched, seqs)
    assert all(s.num_tokens == sched.max_model_len for s in seqs)
