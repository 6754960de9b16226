from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import uuid
from collections.abc import Callable

from ..engine.llm_engine import LLMEngine, PromptType
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams


class EngineDeadError(RuntimeError):
    "The engine loop stopped on an error (or was shut down): every request in it ends with this error."


class RequestOutputStream:
    """One request's outputs as an async iterator. The engine thread `put`s outputs (or an error) into it; the event
    loop awaits them. Closing it, dropping it or cancelling the task that awaits it before the end aborts the request."""

    def __init__(self, llm: AsyncLLM, request_id: str, kind: RequestOutputKind):
        self.llm, self.request_id, self.kind = llm, request_id, kind
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        self.finished, self.total = False, None

    def put(self, item: RequestOutput | BaseException) -> None:
        "Called from the engine thread: hand `item` to the event loop's thread."
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the event loop is closed: nobody waits any more
            pass

    def __aiter__(self) -> RequestOutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:   # cancelled: the request goes
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.llm.streams.pop(self.request_id, None)
        self.total = merge_delta(self.total, item) if self.kind == RequestOutputKind.CUMULATIVE else item
        return self.total

    def close(self) -> None:
        "Abort the request unless it has finished."
        if not self.finished:
            self.finished = True
            self.llm.streams.pop(self.request_id, None)
            self.llm.commands.put(("abort", self.request_id))

    async def aclose(self) -> None:
        self.close()

    def __del__(self):
        self.close()


class AsyncLLM:
    """vLLM's asyncio front end: `async for out in llm.generate(prompt, params, request_id)`. One engine thread steps
    the engine while any number of coroutines add requests, read their outputs, and abort them."""

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(model, **kwargs)   # (made here, so that a bad argument raises here)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()   # what coroutines ask of the engine thread
        self.streams: dict[str, RequestOutputStream] = {}              # the requests being awaited, by id
        self.step_hooks: list[Callable[[list[RequestOutput], float], None]] = []   # metrics, run after each step
        self.error: BaseException | None = None   # what ended the engine loop
        self.dead = False
        self.thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self.thread.start()

    @property
    def is_running(self) -> bool:
        return not self.dead and self.thread.is_alive()

    @property
    def num_waiting(self) -> int:
        "Requests accepted but not running yet (queued for the engine thread, or waiting in the scheduler)."
        return self.commands.qsize() + len(self.engine.scheduler.waiting)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return dataclasses.replace(self.engine.default_params)

    def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None) -> RequestOutputStream:
        """Check and queue one request now (bad input raises here); iterate the result with `async for` to get its
        outputs as the engine makes them: everything so far (CUMULATIVE, the default), only what is new (DELTA), or
        the finished output alone (FINAL_ONLY), per `sampling_params.output_kind`."""
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        checked = self.engine.validate(prompt, sampling_params, f"request {request_id!r}")
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        kind = checked[2].output_kind
        stream = self.streams[request_id] = RequestOutputStream(self, request_id, kind)
        if not self.is_running:   # (checked after registering: a dying engine thread fails every stream it sees)
            stream.finished = True
            self.streams.pop(request_id, None)
            raise EngineDeadError("the engine is not running") from self.error
        self.commands.put(("add", request_id, checked, kind != RequestOutputKind.FINAL_ONLY))
        return stream

    async def abort(self, request_id: str | list[str]) -> None:
        "End requests by id (their generate loops end with an `aborted` output's finish reason, or simply stop)."
        for i in [request_id] if isinstance(request_id, str) else request_id:
            self.commands.put(("abort", i))


    def _run(self) -> None:
        "The engine thread: carry out the commands, step while there is work, hand each output to its stream."
        engine = self.engine
        try:
            while self._apply(wait=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    for out in outputs:
                        if (stream := self.streams.get(out.request_id)) is not None:
                            stream.put(out)
                    for hook in self.step_hooks:
                        hook(outputs, time.perf_counter())
        except BaseException as e:   # the engine loop is over: every waiting request learns why
            self.error = e
        finally:
            self.dead = True
            error = EngineDeadError("the engine was shut down" if self.error is None else
                                    f"the engine loop failed: {self.error!r}")
            for stream in list(self.streams.values()):
                stream.put(error)

    def _apply(self, wait: bool) -> bool:
        "Carry out every queued command (when idle, first wait up to 0.1 s for one); False once asked to stop."
        try:
            command = self.commands.get(timeout=0.1) if wait else self.commands.get_nowait()
            while command is not None:
                kind, request_id, *args = command
                if kind == "add":
                    self._add(request_id, *args)
                else:
                    self.engine.abort_request(request_id)
                    if (stream := self.streams.get(request_id)) is not None:   # still awaited: tell it
                        stream.put(aborted_output(request_id))
                command = self.commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _add(self, request_id: str, checked: tuple, stream: bool) -> None:
        try:
            self.engine._add(*checked, request_id, stream)
        except (ValueError, TypeError) as e:   # (an id still in use by a request that is being aborted)
            if (s := self.streams.get(request_id)) is not None:
                s.put(e)

    def shutdown(self, timeout: float = 60.0) -> None:
        "Stop the engine thread (requests still waiting end with EngineDeadError), then free the model."
        if self.thread.is_alive():
            self.commands.put(None)
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")
        self.engine.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()


def aborted_output(request_id: str) -> RequestOutput:
    "What an aborted request's stream ends with."
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")], finished=True)


def merge_delta(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    "What came before plus a streamed delta, as new lists (an output handed out earlier never changes)."
    if total is None:
        return delta
    merged = {c.index: c for c in total.outputs}
    for c in delta.outputs:
        old = merged.get(c.index)
        merged[c.index] = c if old is None else dataclasses.replace(
            c, text=old.text + c.text, token_ids=old.token_ids + c.token_ids,
            logprobs=None if c.logprobs is None else (old.logprobs or []) + c.logprobs)
    return dataclasses.replace(delta, outputs=[merged[i] for i in sorted(merged)])
