from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    "One generated completion (vLLM's fields)."
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None        # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    "When things happened to a request (seconds on `time.perf_counter`'s clock)."
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        "Mean time between output tokens after the first (None with fewer than two tokens)."
        if self.num_generated_tokens < 2 or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    "A request's prompt and its completion, as `LLM.generate` returns it (vLLM's fields)."
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0              # prompt tokens found in the prefix cache

    def __repr__(self) -> str:
        out = self.outputs[0]
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, text={out.text!r}, "
                f"token_ids={out.token_ids}, finish_reason={out.finish_reason!r}, finished={self.finished})")
