from __future__ import annotations

from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass, field

from .scheduler import Scheduler, StepPlan
from .sequence import Sequence


@dataclass
class StepRecord:
    "One engine step, as plain data: which sequences ran, how many tokens each, and the state after the step."
    step: int
    seq_ids: list[int]
    num_tokens: list[int]
    is_prefill: list[bool]
    sampled: list[bool]
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    start: float | None = None
    duration: float | None = None
    wait: float | None = None        # of the duration, seconds the host waited for the device's result

    @classmethod
    def from_step(cls, step: int, plan: StepPlan, finished: list[Sequence], scheduler: Scheduler,
                  start: float | None = None, duration: float | None = None, wait: float | None = None) -> StepRecord:
        "Record a step after `scheduler.postprocess(plan, ...)` returned `finished` (the plan's lists are not copied)."
        return cls(step, [s.seq_id for s in plan.seqs], plan.num_new_tokens, plan.prefill, plan.sample,
                   [s.seq_id for s in plan.preempted], [s.seq_id for s in finished], len(scheduler.running),
                   len(scheduler.waiting), scheduler.block_manager.usage, start, duration, wait)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_decode_only(self) -> bool:
        return not any(self.is_prefill)

    def span(self, use_time: bool = False) -> tuple[float, float]:
        "Where the step lies on the x axis: [step, step + 1), or [start, start + duration) in seconds."
        if not use_time:
            return float(self.step), float(self.step + 1)
        if self.start is None or self.duration is None:
            raise ValueError(f"step {self.step} has no start/duration; draw it with use_time=False")
        return self.start, self.start + self.duration


def token_times(records: SequenceLike[StepRecord], use_time: bool = False) -> dict[int, list[float]]:
    "For each sequence, when each of its tokens was sampled (the end of the step), in steps or seconds."
    times: dict[int, list[float]] = {}
    for r in records:
        end = r.span(use_time)[1]
        for sid, sampled in zip(r.seq_ids, r.sampled):
            if sampled:
                times.setdefault(sid, []).append(end)
    return times
