"""Soak test (project issue 8): 2,000 random requests through one engine on the tiny model.

The requests mix every feature (greedy, temperature, top-k / top-p / min-p, seeds, stop strings, stop token ids,
logprobs, ignore_eos, max_tokens up to max_model_len, penalties, min_tokens, logit_bias), prompts of every length (token
ids, text, a shared prefix for the prefix cache), and every way in: `LLM.generate` batches, `LLMEngine.add_request` +
`step`, and `LLM.stream` (some streams abandoned half-way). A KV cache of 12 sequences' worth for up to 32 running
sequences keeps it preempting. Each request is kept short (max_model_len 48, prompts up to 44 tokens, max_tokens up to
12 or, for 2% of them, None: up to max_model_len): what it checks is the engine's bookkeeping over many requests, not
long generations, and short requests keep the 2,000 of them cheap.

Checked: every request is answered with a sane output (finished, a finish reason that matches its tokens, lengths
within max_tokens and max_model_len, logprobs that belong to the tokens); repeated greedy and seeded requests give the
same tokens; afterwards the engine holds nothing (no request, no sequence alive, every KV block free, bookkeeping
consistent); and the process memory is flat after warm-up.

Why 50 MB for the memory: after the first 500 requests the engine has touched its whole (small) KV cache and every
code path, and everything per request (sequence, detokenizer, logprobs, outputs) is dropped when the request ends. What
may still move is the allocators' slack: glibc arenas and PyTorch's CPU caching of temporaries, which varies with the
largest batch seen so far, a few MB to a few tens of MB. A real leak of what a request holds (its sequence, token
lists, logprobs dicts, about 10-50 kB) over the 1,500 requests after warm-up is 15-75 MB, and a leaked KV block or
tensor per step far more; the object census below catches smaller leaks of engine objects exactly.
"""

from __future__ import annotations

import gc
import math
import random
import time
import weakref

import psutil
import pytest

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.engine.output_processor import Request
from minivllm.engine.sequence import Sequence
from minivllm.models.registry import load_config

NUM_REQUESTS = 2000
WARMUP = 500
MAX_MODEL_LEN = 48
RSS_GROWTH_LIMIT = 50 * 2**20
VOCAB = load_config(TINY_MODEL_PATH).vocab_size
SNIPPETS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        ",
    "for i in range(10):\n",
    "    return",
    "try:\n    import json\nexcept ImportError:\n",
    "x = [",
    "# ",
]
HEADER = list(range(100, 132))  # 32 tokens = 2 full blocks, shared by some prompts: the prefix cache gets hits
STOPS = ["\n", "(", "):", " = ", "def", "\n\n"]


def random_prompt(rng: random.Random) -> str | list[int]:
    kind = rng.random()
    if kind < 0.6:
        return [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
    if kind < 0.8:
        return rng.choice(SNIPPETS) + rng.choice(["", "a", "foo(", "\n"])
    return HEADER + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))]


def random_params(rng: random.Random) -> SamplingParams:
    kw = {}
    if rng.random() < 0.3:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.uniform(0.3, 1.5)
        if rng.random() < 0.3:
            kw["top_k"] = rng.randint(1, 50)
        if rng.random() < 0.3:
            kw["top_p"] = rng.uniform(0.5, 1.0)
        if rng.random() < 0.2:
            kw["min_p"] = rng.uniform(0.0, 0.3)
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(2**32)
    kw["max_tokens"] = None if rng.random() < 0.02 else rng.randint(1, 12)
    if rng.random() < 0.2:
        kw["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.15:
        kw["stop_token_ids"] = rng.sample(range(1, 300), 3)
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randint(0, 3)
    kw["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.15:  # the logits processors: their token history lives on through preemptions
        kw.update(
            presence_penalty=rng.uniform(-1, 2),
            frequency_penalty=rng.uniform(0, 1),
            repetition_penalty=rng.uniform(0.8, 1.5),
        )
    if rng.random() < 0.1:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"] or 16)
    if rng.random() < 0.05:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)}
    return SamplingParams(**kw)


class Checker:
    "Checks each output as it arrives (nothing is kept but what the repeat checks need)."

    def __init__(self, llm: LLM):
        self.tokenizer, self.eos = llm.get_tokenizer(), set(llm.llm_engine.config.eos_token_ids)
        self.answered, self.reasons, self.cached_tokens = 0, {}, 0
        self.repeatable: dict[tuple, list[int]] = {}  # greedy or seeded request -> its tokens
        self.repeats = 0

    def key(self, prompt, params: SamplingParams) -> tuple | None:
        "Requests whose tokens must be the same every time: greedy, or seeded."
        if not (params.greedy or params.seed is not None):
            return None
        prompt = tuple(prompt) if isinstance(prompt, list) else prompt
        return (prompt, repr(params))

    def check(self, prompt, params: SamplingParams, out) -> None:
        c = out.outputs[0]
        ids, n = c.token_ids, len(c.token_ids)
        prompt_ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        assert out.finished and out.prompt_token_ids == prompt_ids
        assert c.finish_reason in ("stop", "length"), c
        limit = min(params.max_tokens or math.inf, MAX_MODEL_LEN - len(prompt_ids))
        assert 1 <= n <= limit, (n, limit)
        assert c.finish_reason == "length" or n > params.min_tokens, "stopped before min_tokens"
        if c.finish_reason == "length":
            assert n == limit and c.stop_reason is None
        elif isinstance(c.stop_reason, int):
            assert ids[-1] == c.stop_reason and c.stop_reason in params.stop_token_ids
        elif isinstance(c.stop_reason, str):
            assert c.stop_reason in params.stop  # (a stop string within the first min_tokens tokens stops nothing)
            assert params.min_tokens or not any(s in c.text for s in params.stop)
        else:
            assert ids[-1] in self.eos and not params.ignore_eos
        stoppers = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)
        assert not stoppers & set(ids[:-1]), "a stop token before the end"
        if params.logprobs is None:
            assert c.logprobs is None and c.cumulative_logprob is None
        else:
            assert len(c.logprobs) == n
            for token, entry in zip(ids, c.logprobs):
                assert token in entry and len(entry) <= params.logprobs + 1
                assert all(lp.logprob <= 1e-4 and lp.rank >= 1 for lp in entry.values())
            assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(ids, c.logprobs)), abs=1e-3)
        key = self.key(prompt, params)
        if key is not None:
            if key in self.repeatable:
                assert ids == self.repeatable[key], "a greedy or seeded request gave other tokens the second time"
                self.repeats += 1
            self.repeatable[key] = ids
        self.answered += 1
        self.reasons[c.finish_reason] = self.reasons.get(c.finish_reason, 0) + 1
        self.cached_tokens += out.num_cached_tokens


def census() -> dict[int, weakref.ref]:
    "The Sequences and Requests alive now (other tests' leftovers, if any), by id."
    gc.collect()
    return {id(o): weakref.ref(o) for o in gc.get_objects() if type(o) in (Sequence, Request)}


def live_since(before: dict[int, weakref.ref]) -> tuple[int, int]:
    "Sequences and Requests of this test still alive (other tests' leftovers, if any, are not counted)."
    gc.collect()
    new = [
        o
        for o in gc.get_objects()
        if type(o) in (Sequence, Request)  # (type: isinstance warns on some objects)
        and not (id(o) in before and before[id(o)]() is o)
    ]  # (an id of a dead leftover may be reused)
    return sum(type(o) is Sequence for o in new), sum(type(o) is Request for o in new)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.mark.slow
def test_soak():
    rng = random.Random(2025)
    leftovers = census()  # engines number their sequences from 0: the objects alive before tell this test's apart
    start = time.perf_counter()
    llm = LLM(
        TINY_MODEL_PATH,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        num_kvcache_blocks=12 * MAX_MODEL_LEN // 16,
    )
    engine, checker = llm.llm_engine, Checker(llm)
    bm = engine.scheduler.block_manager
    history: list[tuple] = []  # some greedy/seeded requests, to be sent again later
    abandoned = 0
    rss_warm = None

    def next_request():
        if history and rng.random() < 0.05:
            return rng.choice(history)
        prompt, params = random_prompt(rng), random_params(rng)
        if checker.key(prompt, params) is not None and len(history) < 200:
            history.append((prompt, params))
        return prompt, params

    while checker.answered + abandoned < NUM_REQUESTS:
        if rss_warm is None and checker.answered >= WARMUP:
            rss_warm, warm_answered = rss(), checker.answered
        mode = rng.random()
        if mode < 0.55:  # a generate call
            batch = [next_request() for _ in range(rng.randint(1, 64))]
            outputs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
            for (prompt, params), out in zip(batch, outputs):
                checker.check(prompt, params, out)
        elif mode < 0.85:  # requests added one by one, the engine stepped by hand
            batch = {}
            for _ in range(rng.randint(1, 32)):
                prompt, params = next_request()
                batch[engine.add_request(None, prompt, params)] = (prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        checker.check(*batch.pop(out.request_id), out)
            assert not batch
        else:  # a stream, sometimes abandoned after a few tokens
            prompt, params = next_request()
            stop_after = rng.randint(1, 4) if rng.random() < 0.5 else None
            text, ids, logprobs = "", [], []
            for i, delta in enumerate(llm.stream(prompt, params)):
                c = delta.outputs[0]
                text, ids, logprobs = text + c.text, ids + c.token_ids, logprobs + (c.logprobs or [])
                if stop_after is not None and i + 1 == stop_after and not delta.finished:
                    abandoned += 1
                    break
            else:  # the deltas put together are the whole output
                c.text, c.token_ids, c.logprobs = text, ids, None if params.logprobs is None else logprobs
                checker.check(prompt, params, delta)
            assert not engine.requests
        assert bm.num_free_blocks == bm.num_blocks and not engine.requests

    elapsed = time.perf_counter() - start
    rss_end = rss()
    stats = engine.stats
    print(
        f"\nsoak: {checker.answered} answered + {abandoned} abandoned streams in {elapsed:.0f} s; "
        f"{stats.num_steps} steps, {stats.num_prompt_tokens} prompt + {stats.num_generated_tokens} generated tokens, "
        f"{stats.num_preemptions} preemptions, {checker.cached_tokens} prompt tokens from the prefix cache, "
        f"{checker.repeats} repeats; finish reasons {checker.reasons}; RSS {rss_warm / 2**20:.0f} MB after "
        f"{warm_answered} requests -> {rss_end / 2**20:.0f} MB at the end"
    )
    # every request answered; the engine is empty and consistent
    assert checker.answered + abandoned >= NUM_REQUESTS and abandoned > 0
    assert engine.requests == {} and engine.outputs.by_seq == {} and not engine.outputs.watched
    assert not engine.scheduler.has_unfinished() and engine.in_flight is None
    sampling = engine.executor.runner.sampling
    assert bm.num_free_blocks == bm.num_blocks and sampling.generators == {} and sampling.params == {}
    assert engine.builder.tables.rows == {}  # every block-table row given back
    engine.scheduler.check_invariants()
    assert live_since(leftovers) == (0, 0)
    # the workload did what it was meant to
    assert stats.num_preemptions > 0 and checker.cached_tokens > 0 and checker.repeats > 20
    assert set(checker.reasons) == {"stop", "length"}
    # memory flat after warm-up
    assert rss_end - rss_warm < RSS_GROWTH_LIMIT, f"RSS grew {(rss_end - rss_warm) / 2**20:.1f} MB"
    llm.close()
