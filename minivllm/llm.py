from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence as SequenceABC
from numbers import Integral

from fastcore.basics import patch
from tqdm.auto import tqdm

from .engine.llm_engine import LLMEngine, PromptType
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def as_prompt_list(prompts) -> list[PromptType]:
    "One prompt (text, token ids or a prompt dict) or a list of prompts -> a list of prompts."
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, SequenceABC) and any(isinstance(t, Integral) for t in prompts):
        return [list(prompts)]  # a single prompt of token ids (a stray non-int in it is reported as such)
    if isinstance(prompts, SequenceABC):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of these, "
                    f"got {type(prompts).__name__}")


def params_list(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, SequenceABC) or isinstance(params, str):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or exactly one per prompt")
    return list(params)

# %%
class Progress:
    "A tqdm bar over finished requests, with prefill and decode speeds from the engine's counters."

    def __init__(self, engine: LLMEngine, total: int, enabled: bool):
        self.engine, self.bar = engine, tqdm(total=total, desc="Processed prompts", disable=not enabled,
                                             dynamic_ncols=True)
        s = engine.stats
        self.start = (s.num_prompt_tokens, s.prefill_time, s.num_generated_tokens, s.decode_time)

    def update(self, finished: int) -> None:
        s, (p0, pt0, g0, dt0) = self.engine.stats, self.start
        prefill = (s.num_prompt_tokens - p0) / max(s.prefill_time - pt0, 1e-9)
        decode = (s.num_generated_tokens - g0) / max(s.prefill_time + s.decode_time - pt0 - dt0, 1e-9)
        self.bar.set_postfix_str(f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s", refresh=False)
        self.bar.update(finished)

    def close(self) -> None:
        self.bar.close()

# %%
class LLM:
    "vLLM's offline entry point: `LLM(model).generate(prompts, sampling_params)`."

    def __init__(self, model: str, **kwargs):
        self.llm_engine = LLMEngine(model, **kwargs)

    def _engine(self) -> LLMEngine:
        if self.llm_engine is None:
            raise RuntimeError("this LLM is closed (its model and KV cache were released): make a new LLM")
        return self.llm_engine

    def get_tokenizer(self):
        return self._engine().tokenizer

    def _run(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        engine = self._engine()
        prompts = as_prompt_list(prompts)
        params = params_list(sampling_params, len(prompts))
        checked = [engine.validate(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        before = set(engine.requests)   # requests a caller queued with add_request are not this call's to abort
        results: dict[str, RequestOutput] = {}
        progress = Progress(engine, len(checked), use_tqdm)
        try:
            ids = [engine._add(*c) for c in checked]
            own = set(ids)   # other requests in the engine (from add_request) are stepped too, not returned
            while len(results) < len(ids):
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine has no unfinished requests but some outputs are missing")
                done = [o for o in engine.step() if o.finished and o.request_id in own]
                results.update((o.request_id, o) for o in done)
                progress.update(len(done))
        except BaseException:   # a failed step or Ctrl-C: this call's requests go, their blocks are freed
            for request_id in set(engine.requests) - before:
                engine.abort_request(request_id)
            raise
        finally:
            progress.close()
        return [results[i] for i in ids]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        "Complete every prompt; the outputs come back in the order of the prompts."
        return self._run(prompts, sampling_params, use_tqdm)

# %%
@patch
def chat(self: LLM, messages: list[dict] | list[list[dict]],
         sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
         add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
    "Apply the tokenizer's chat template to one conversation or a list of them, then generate."
    tokenizer = self.get_tokenizer()
    if tokenizer is None:
        raise ValueError("chat() needs a tokenizer (the engine was made with skip_tokenizer_init=True)")
    conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    for i, c in enumerate(conversations):
        if not (isinstance(c, list) and c and all(isinstance(m, dict) for m in c)):
            raise TypeError(f"chat() takes a conversation (a list of message dicts such as {{'role': 'user', "
                            f"'content': 'Hi'}}) or a list of them; conversation {i} is {c!r:.60}")
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {})) for c in conversations]
    return self._run(prompts, sampling_params, use_tqdm)


@patch
def stream(self: LLM, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
    "Yield a `RequestOutput` holding only the new text and tokens each time the request produces some."
    engine = self._engine()
    request_id = engine._add(*engine.validate(prompt, sampling_params), stream=True)
    try:
        finished = False
        while not finished:
            for out in engine.step():
                if out.request_id == request_id:
                    finished = out.finished
                    yield out
    finally:
        engine.abort_request(request_id)   # a no-op once finished; frees the blocks if the caller stopped early

# %%
@patch
def close(self: LLM) -> None:
    "Free the model and the KV cache (and stop worker processes, with tensor parallelism)."
    engine = getattr(self, "llm_engine", None)   # absent when the constructor failed
    if engine is not None:
        self.llm_engine = None
        engine.close()


@patch
def __enter__(self: LLM) -> LLM:
    return self


@patch
def __exit__(self: LLM, *exc) -> None:
    self.close()


@patch
def __del__(self: LLM):
    with contextlib.suppress(Exception):
        self.close()
