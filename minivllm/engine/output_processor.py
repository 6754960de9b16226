from __future__ import annotations

from dataclasses import dataclass

from fastcore.basics import patch

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence


class IncrementalDetokenizer:
    "Text of a growing completion, a few tokens at a time (vLLM's / TGI's prefix and read offsets)."

    def __init__(self, tokenizer, prompt_token_ids: list[int], context: int = 5):
        self.tokenizer, self.text = tokenizer, ""
        self.ids = list(prompt_token_ids[-context:])   # a little prompt, so the first token decodes in context
        self.prefix_offset, self.read_offset = 0, len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        "Append new token ids; return the new text they complete (possibly empty)."
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta, self.prefix_offset, self.read_offset = full[len(prefix):], self.read_offset, len(self.ids)
        self.text += delta
        return delta

# %%
def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    "The earliest stop string that ends in the last `new_chars` characters of `text`: (where it starts, which)."
    best = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best

# %%
@dataclass
class Request:
    request_id: str
    prompt: str | None
    seq: Sequence
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None = None   # when text is needed as it is generated
    stream: bool = False                                 # outputs are deltas
    text: str | None = None                              # the final text, once finished
    sent_chars: int = 0
    sent_tokens: int = 0

    def current_text(self, tokenizer) -> str:
        if self.text is not None:
            return self.text
        if self.detokenizer is not None:
            return self.detokenizer.text
        return "" if tokenizer is None else tokenizer.decode(self.seq.completion_token_ids, skip_special_tokens=True)

    def output(self, tokenizer) -> RequestOutput:
        seq = self.seq
        text, ids = self.current_text(tokenizer), seq.completion_token_ids
        logprobs = seq.logprobs if seq.sampling_params.logprobs is not None else None
        if self.stream:
            stops = seq.sampling_params.stop
            if stops and not seq.is_finished:   # hold back what may be the start of a stop string (it is not output)
                text = text[:max(0, len(text) - max(map(len, stops)) + 1)]
            text, ids = text[self.sent_chars:], ids[self.sent_tokens:]
            logprobs = None if logprobs is None else logprobs[self.sent_tokens:]
            self.sent_chars += len(text)
            self.sent_tokens += len(ids)
        cumulative = seq.cumulative_logprob if seq.sampling_params.logprobs is not None else None
        completion = CompletionOutput(0, text, ids, cumulative, logprobs, seq.finish_reason, seq.stop_reason)
        return RequestOutput(self.request_id, self.prompt, seq.prompt_token_ids, [completion], seq.is_finished,
                             self.metrics, seq.num_cached_tokens)

# %%
class OutputProcessor:
    "Books each step's new tokens on their requests (logprobs, metrics, text, stop strings) and makes the outputs."

    def __init__(self, tokenizer, scheduler: Scheduler):
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self.requests: dict[str, Request] = {}
        self.by_seq: dict[int, Request] = {}
        self.watched: set[int] = set()   # the sequences whose requests need work per token (text, streaming)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = self.by_seq[req.seq.seq_id] = req
        if req.detokenizer is not None or req.stream:
            self.watched.add(req.seq.seq_id)

    def remove(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.by_seq.pop(req.seq.seq_id, None)
        self.watched.discard(req.seq.seq_id)

    def process(self, plan: StepPlan, token_ids: list[int], logprobs: list | None, finished: list[Sequence],
                now: float) -> tuple[list[RequestOutput], list[Request]]:
        "The outputs of one collected step, and the requests that are done (finished by it, or by a stop string)."
        if logprobs is None and not self.watched and not plan.num_prefill_tokens:
            # a decode step of requests that need nothing per token: only the finished ones are booked
            booked = [(self.by_seq[s.seq_id], s.last_token, None) for s in finished]
        else:
            booked = [(self.by_seq[s.seq_id], t, None if logprobs is None else logprobs[i])
                      for i, (s, t) in enumerate(zip(plan.sampled, token_ids)) if s.seq_id in self.by_seq]
        outputs, done = [], []
        for req, token_id, token_logprobs in booked:
            out = self._book(req, token_id, token_logprobs, now)
            if out is not None:
                outputs.append(out)
            if req.seq.is_finished:
                self.remove(req)
                done.append(req)
        return outputs, done

# %%
@patch
def _book(self: OutputProcessor, req: Request, token_id: int, logprobs: dict[int, float] | None, now: float
          ) -> RequestOutput | None:
    "Book one new token of `req`; its output only when it finished or streams (unread outputs would cost dearly)."
    seq, metrics = req.seq, req.metrics
    if logprobs is not None:
        seq.logprobs.append(logprobs)
        seq.cumulative_logprob += logprobs[token_id]
    metrics.first_token_time = metrics.first_token_time or now
    metrics.last_token_time, metrics.num_generated_tokens = now, seq.num_completion_tokens
    if req.detokenizer is not None:
        new_text = req.detokenizer.add([token_id])
        hit = find_stop(req.detokenizer.text, len(new_text), seq.sampling_params.stop) if new_text else None
        if hit is not None:
            req.text = req.detokenizer.text[:hit[0]]
            if seq.is_finished:   # the same token also hit a length limit: the stop string wins, as in vLLM
                seq.finish_reason, seq.stop_reason = "stop", hit[1]
            else:
                self.scheduler.finish(seq, "stop", hit[1])
    if seq.is_finished:
        metrics.finished_time = now
        if req.text is None and self.tokenizer is not None:
            req.text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
    return req.output(self.tokenizer) if seq.is_finished or req.stream else None
