from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fastcore.basics import patch

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

POLICIES = ("mixed", "prefill_first")


@dataclass
class StepPlan:
    "One step's work: which sequences run, how many of their next tokens each computes, and what follows from it."
    seqs: list[Sequence]
    num_new_tokens: list[int]      # sequence i computes its tokens [num_computed, num_computed + n)
    sample: list[bool]             # the step reaches the sequence's end: a new token is sampled for it
    prefill: list[bool]            # prompt (or recomputed) tokens, not a decode
    sampled: list[Sequence]        # the sequences of `sample`, in order: one sampled token each
    num_prefill_tokens: int        # new tokens of the `prefill` sequences
    preempted: list[Sequence] = field(default_factory=list)   # pushed out of memory while the step was planned
    ahead_rows: list[int] | None = None   # planned ahead (10): input token i is row ahead_rows[i] of the last samples

    @classmethod
    def of(cls, seqs: list[Sequence], num_new_tokens: list[int], preempted: list[Sequence] | None = None) -> StepPlan:
        "The plan of any step: the flags are worked out from where each sequence stands."
        sample = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, num_new_tokens)]
        prefill = [not (n == 1 and s.num_prompt_tokens <= s.num_computed_tokens == s.num_tokens - 1)
                   for s, n in zip(seqs, num_new_tokens)]
        return cls(seqs, num_new_tokens, sample, prefill, [s for s, m in zip(seqs, sample) if m],
                   sum(n for n, p in zip(num_new_tokens, prefill) if p), preempted or [])

    @classmethod
    def decode(cls, seqs: list[Sequence], ahead_rows: list[int] | None = None) -> StepPlan:
        n = len(seqs)
        return cls(seqs, [1] * n, [True] * n, [False] * n, seqs, 0, ahead_rows=ahead_rows)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        "Every sequence computes exactly one token (the shape CUDA graphs are captured for)."
        return bool(self.seqs) and self.num_new_tokens.count(1) == len(self.num_new_tokens)

# %%
def check_stop(seq: Sequence, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
               ) -> tuple[str | None, int | None]:
    "Whether `seq` stops after sampling `token_id`: (finish_reason, stop_reason), or (None, None) to go on."
    params = seq.sampling_params
    if token_id in eos_token_ids and not params.ignore_eos:
        return "stop", None
    if token_id in params.stop_token_ids:
        return "stop", token_id
    if seq.num_tokens >= seq.max_num_tokens or seq.num_tokens >= max_model_len:   # max_tokens generated, or the limit
        return "length", None
    return None, None

# %%
class Scheduler:
    "Continuous batching over a paged KV cache: decides which sequences run in each step, and how many tokens each."

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_id: int | list[int] | None = None,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True, policy: str = "mixed"):
        "The limits come validated by the engine's `Config` (notebook 09), or are the notebooks' own."
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size, self.max_num_seqs, self.max_model_len = block_size, max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids, self.enable_chunked_prefill, self.policy = frozenset(eos), enable_chunked_prefill, policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order
        self.num_preemptions = self.num_finished = 0   # num_finished: sequences ended, for any reason

    def __repr__(self) -> str:
        return (f"Scheduler({len(self.waiting)} waiting, {len(self.running)} running, "
                f"{self.block_manager.num_free_blocks}/{self.block_manager.num_blocks} blocks free, "
                f"{self.num_preemptions} preemptions)")

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        "End a sequence wherever it is (running or waiting) and free its blocks: 'stop', 'length' or 'abort'."
        if seq.is_finished:
            return
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        self.num_finished += 1

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")

# %%
@patch
def schedule(self: Scheduler) -> StepPlan:
    "Choose this step's sequences and how many tokens each computes; allocate their blocks."
    scheduled: list[tuple[Sequence, int]] = []
    preempted: list[Sequence] = []
    budget = self.max_num_batched_tokens
    if self.policy == "mixed":
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
    else:  # prefill_first: prompt work if there is any, else decodes
        budget = self._schedule_running(budget, scheduled, preempted, prefill=True)
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled)
        if not scheduled:
            self._schedule_running(budget, scheduled, preempted, prefill=False)
    if not scheduled and self.has_unfinished():
        raise RuntimeError(f"the scheduler could not schedule anything: {self!r}")
    return StepPlan.of([s for s, _ in scheduled], [n for _, n in scheduled], preempted)


@patch
def _schedule_running(self: Scheduler, budget: int, scheduled: list, preempted: list,
                      prefill: bool | None = None) -> int:
    "Give running sequences their next tokens, in admission order (only prompt work, or only decodes, if asked)."
    i = 0
    while i < len(self.running) and budget > 0:
        seq = self.running[i]
        i += 1
        if prefill is not None and (seq.num_uncomputed_tokens > 1) != prefill:
            continue
        n = min(seq.num_uncomputed_tokens, budget)
        if n != 1 or seq.num_computed_tokens >= len(seq.block_table) * self.block_size:  # not a decode in a held block
            if not self._make_room(seq, n, preempted):
                break   # seq itself was preempted, and with it every sequence after it
            self.block_manager.allocate(seq, n)
        scheduled.append((seq, n))
        budget -= n
    return budget

# %%
@patch
def _make_room(self: Scheduler, seq: Sequence, num_new_tokens: int, preempted: list) -> bool:
    "Preempt the most recently admitted sequences until `seq` fits; False if `seq` itself had to go."
    bm = self.block_manager
    while not bm.can_allocate(seq, num_new_tokens):
        if len(self.running) == 1:
            raise RuntimeError(f"sequence {seq.seq_id} needs {bm.blocks_needed(seq, num_new_tokens)} more KV blocks, "
                               f"but only {bm.num_free_blocks} of {bm.num_blocks} are free with no other sequence "
                               f"left to preempt")
        victim = self.running.pop()
        self._preempt(victim)
        preempted.append(victim)
        if victim is seq:
            return False
    return True


@patch
def _preempt(self: Scheduler, seq: Sequence) -> None:
    "Recompute later: free the blocks, forget the computed tokens, wait at the front of the queue."
    self.block_manager.free(seq)
    seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
    seq.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(seq)

# %%
@patch
def _schedule_waiting(self: Scheduler, budget: int, scheduled: list) -> int:
    "Admit waiting prompts, first come first served, while budget, blocks and max_num_seqs allow."
    bm, computing = self.block_manager, set()   # computing: the first uncached block of each prompt admitted
    while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
        seq = self.waiting[0]
        match = bm.match_prefix(seq)   # once per admission, passed along
        if match.first_missing is not None and match.first_missing in computing:
            break   # a prompt admitted in this step computes that block: from the next step on it is cached
        n = seq.num_tokens - match.num_tokens
        if n > budget and not self.enable_chunked_prefill:
            break
        n = min(n, budget)
        if not bm.can_allocate(seq, n, match):
            break
        self.waiting.popleft()
        bm.allocate(seq, n, match)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        scheduled.append((seq, n))
        budget -= n
        computing.add(match.first_missing)
    return budget

# %%
@patch
def postprocess(self: Scheduler, plan: StepPlan, token_ids: list[int]) -> list[Sequence]:
    "After the step: advance the sequences, commit full blocks, append the sampled tokens, stop; returns the finished."
    finished, sampled, bs, eos, limit = [], iter(token_ids), self.block_size, self.eos_token_ids, self.max_model_len
    for seq, n, sample in zip(plan.seqs, plan.num_new_tokens, plan.sample):
        token_id = next(sampled) if sample else None
        if seq.status is SequenceStatus.FINISHED:   # aborted while the step ran: left as it is
            continue
        before = seq.num_computed_tokens
        seq.num_computed_tokens = before + n
        if (before + n) // bs > before // bs:   # a block filled up
            self.block_manager.commit(seq, before // bs)
        if token_id is None:
            continue
        seq.token_ids.append(token_id)   # (the hot loop of a decode step: no method calls it can do without)
        length, stop_ids = len(seq.token_ids), seq.sampling_params.stop_token_ids
        if length >= seq.max_num_tokens or length >= limit or token_id in eos or token_id in stop_ids:
            reason, stop_reason = check_stop(seq, token_id, eos, limit)   # (the cheap test above rules most out)
            if reason is not None:
                self.finish(seq, reason, stop_reason)
                finished.append(seq)
    return finished

# %%
@patch
def check_invariants(self: Scheduler) -> None:
    "Raise RuntimeError if the queues or the block bookkeeping are inconsistent (the tests call it every step)."
    self.block_manager.check_invariants(self.running)
    problems = [f"waiting sequence {s.seq_id} holds blocks" for s in self.waiting if s.block_table]
    problems += [f"running sequence {s.seq_id} is {s.status.name}" for s in self.running
                 if s.status is not SequenceStatus.RUNNING]
    problems += [f"sequence {s.seq_id} computed {s.num_computed_tokens} tokens in {len(s.block_table)} blocks"
                 for s in self.running if s.num_computed_tokens > len(s.block_table) * self.block_size]
    if len(self.running) > self.max_num_seqs:
        problems.append(f"{len(self.running)} running sequences > max_num_seqs ({self.max_num_seqs})")
    if problems:
        raise RuntimeError("scheduler invariants broken: " + "; ".join(problems[:5]))
