from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from fastcore.basics import patch

from ..config import Config
from ..outputs import RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from .batch_builder import BatchBuilder
from .executor import Executor
from .inputs import PromptType, checked_params, load_tokenizer, prompt_token_ids
from .lookahead import plan_lookahead
from .output_processor import IncrementalDetokenizer, OutputProcessor, Request
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence
from .step_trace import StepRecord


@dataclass
class EngineStats:
    "Counters over the engine's life (progress bars, benchmarks and tests read them)."
    num_steps: int = 0
    num_prompt_tokens: int = 0       # prompt tokens computed (recomputation after preemption included)
    num_generated_tokens: int = 0
    prefill_time: float = 0.0        # seconds in steps that computed prompt tokens
    decode_time: float = 0.0         # seconds in decode-only steps
    num_preemptions: int = 0         # sequences pushed out of a full KV cache, to be recomputed later


@dataclass
class InFlightStep:
    "A step launched on the device whose tokens the host has not seen yet."
    plan: StepPlan
    handle: object   # what the executor's `collect` needs to finish it


def make_executor(config: Config) -> Executor:
    "One device: a runner in this process. Several (tensor parallelism, notebook 12): one process per device."
    if config.tensor_parallel_size == 1:
        return Executor(config)
    from .multiproc_executor import make_tp_executor
    return make_tp_executor(config)

# %%
class LLMEngine:
    "Requests in, `RequestOutput`s out: the scheduler, the executor and the output processor, stepped together."

    def __init__(self, model: str, **kwargs):
        self.config = c = Config.from_kwargs(model, **kwargs)
        self.tokenizer = None if c.skip_tokenizer_init else load_tokenizer(c.model, c.hf_config.vocab_size)
        self.executor = make_executor(c)
        try:   # from here on a failure must not keep the model's memory (a notebook keeps the traceback alive)
            self.scheduler = Scheduler(self.executor.num_blocks, c.block_size, c.max_num_seqs,
                                       c.max_num_batched_tokens, c.max_model_len, c.eos_token_ids,
                                       c.enable_chunked_prefill, c.enable_prefix_caching)
            self.builder = BatchBuilder(c.block_size, c.max_model_len, c.max_num_seqs, c.cascade)
            self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        except BaseException:
            self.executor.close()
            raise
        self.stats = EngineStats()
        self.in_flight: InFlightStep | None = None   # a step launched ahead (asynchronous scheduling)
        self.trace: list[StepRecord] | None = None   # a record of every step, from `start_trace()` on
        self._seq_ids, self._request_ids = itertools.count(), itertools.count()

    @property
    def requests(self) -> dict[str, Request]:
        return self.outputs.requests

    def validate(self, prompt: PromptType, params: SamplingParams | None, name: str = "prompt"
                 ) -> tuple[str | None, list[int], SamplingParams]:
        "Check one request completely, without queueing it: (text, token ids, params)."
        params = checked_params(params, name)
        text, ids = prompt_token_ids(prompt, self.tokenizer, self.config.hf_config.vocab_size,
                                     self.config.max_model_len, name)
        return text, ids, params

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False) -> str:
        name = "request" if request_id is None else f"request {str(request_id)!r}"
        return self._add(*self.validate(prompt, params, name), request_id, stream)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

# %%
@patch
def _add(self: LLMEngine, text: str | None, ids: list[int], params: SamplingParams, request_id: str | None = None,
         stream: bool = False) -> str:
    if request_id is None:   # the next free number (a caller's own ids may have taken some)
        request_id = next(i for i in map(str, self._request_ids) if i not in self.requests)
    request_id = str(request_id)
    if request_id in self.requests:
        raise ValueError(f"request id {request_id!r} is already in use")
    seq = Sequence(ids, params, self.config.block_size, seq_id=next(self._seq_ids))
    needs_text = self.tokenizer is not None and (bool(params.stop) or stream)
    detokenizer = IncrementalDetokenizer(self.tokenizer, ids) if needs_text else None
    self.outputs.add(Request(request_id, text, seq, RequestMetrics(seq.arrival_time), detokenizer, stream))
    self.executor.add_request(seq.seq_id, params)
    self.scheduler.add(seq)
    return request_id


@patch
def abort_request(self: LLMEngine, request_id: str) -> None:
    "End a request wherever it is; its blocks return to the free list."
    req = self.requests.get(request_id)
    if req is not None:
        self.outputs.remove(req)
        self._release(req)
        self.scheduler.abort(req.seq)


@patch
def _release(self: LLMEngine, req: Request) -> None:
    self.executor.free_request(req.seq.seq_id)
    self.builder.free(req.seq.seq_id)


@patch
def close(self: LLMEngine) -> None:
    "Abort every request and release the model and the KV cache; the engine cannot run after this."
    for request_id in list(self.requests):
        self.abort_request(request_id)
    self.in_flight = None
    self.executor.close()

# %%
@patch
def step(self: LLMEngine) -> list[RequestOutput]:
    "Launch a planned step (or take the one launched ahead), collect its tokens; the finished and streaming outputs."
    start, current, self.in_flight = time.perf_counter(), self.in_flight, None
    try:
        current = current or self._launch(self.scheduler.schedule())
        if current is None:
            return []
        if self.config.async_scheduling:   # the next decode step goes to the device before this one is collected
            self.in_flight = self._launch(plan_lookahead(self.scheduler, current.plan))
        waiting = time.perf_counter()
        token_ids, logprobs = self.executor.collect(current.handle)
        now = time.perf_counter()
        finished = self.scheduler.postprocess(current.plan, token_ids)
        outputs, done = self.outputs.process(current.plan, token_ids, logprobs, finished, now)
    except BaseException:
        self.in_flight = None
        self.executor.synchronize()   # let launched work finish before anything reuses its blocks
        raise
    for req in done:
        self._release(req)
    if done and self.in_flight and all(seq.is_finished for seq in self.in_flight.plan.seqs):
        self.executor.collect(self.in_flight.handle)   # planned ahead for requests that have all ended since
        self.in_flight = None
    self._count(current.plan, finished, start, now - waiting)
    return outputs


@patch
def _launch(self: LLMEngine, plan: StepPlan | None) -> InFlightStep | None:
    if not plan:   # nothing planned (ahead), or nothing to run
        return None
    self.stats.num_preemptions += len(plan.preempted)
    if plan.num_prefill_tokens:   # (a sequence is first scheduled for its prompt)
        now = time.perf_counter()
        for seq in plan.seqs:
            metrics = self.outputs.by_seq[seq.seq_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
    return InFlightStep(plan, self.executor.launch(self.builder.build(plan)))

# %%
@patch
def _count(self: LLMEngine, plan: StepPlan, finished: list[Sequence], start: float, wait: float) -> None:
    stats, end = self.stats, time.perf_counter()
    stats.num_steps += 1
    stats.num_prompt_tokens += plan.num_prefill_tokens
    stats.num_generated_tokens += len(plan.sampled)
    if plan.num_prefill_tokens:
        stats.prefill_time += end - start
    else:
        stats.decode_time += end - start
    if self.trace is not None:
        self.trace.append(StepRecord.from_step(len(self.trace), plan, finished, self.scheduler,
                                               start - self._trace_start, end - start, wait))


@patch
def start_trace(self: LLMEngine) -> list[StepRecord]:
    "Record every step from now on (`engine.trace`, times in seconds from now); returns the list it fills."
    self._trace_start, self.trace = time.perf_counter(), []
    return self.trace
