"""Penalties, min_tokens, logit_bias, allowed_token_ids and bad_words (project issue 14): the repetition penalty against
transformers' own processor (greedy tokens equal to `generate(repetition_penalty=...)`), the others against a float64
reference of vLLM's formulas; the same tokens with and without asynchronous scheduling (and, on a GPU, under CUDA
graphs); the device-side history survives preemption."""

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.engine.sampling_cache import SamplingRegistry
from minivllm.layers.logits_processors import TokenHistory, apply_penalties, build_logits_processors

PROMPTS = [
    "def fibonacci(n):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "import os\nimport sys\n\n",
    "for i in range(10):\n",
]


@pytest.fixture(scope="module")
def tiny():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    return tok, hf, [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm():
    with LLM(TINY_MODEL_PATH, max_model_len=128) as llm:
        yield llm


def generate_ids(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_gives_the_greedy_tokens_of_transformers(tiny, llm, penalty):
    tok, hf, ids = tiny
    want = []
    for p in ids:
        x = torch.tensor([p])
        y = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False, repetition_penalty=penalty
        )
        want.append(y[0, len(p) :].tolist())
    got = generate_ids(llm, ids, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=penalty))
    assert got == want
    assert got != generate_ids(llm, ids, SamplingParams(temperature=0, max_tokens=24))  # the penalty did something


def reference_logits(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams, stop_ids: list[int]
) -> torch.Tensor:
    """vLLM's formulas for one row, in float64, token by token: allowed ids, bad words, min_tokens, logit_bias,
    penalties."""
    x = logits.double().clone()
    if p.allowed_token_ids is not None:
        keep = torch.full_like(x, -math.inf)
        keep[p.allowed_token_ids] = x[p.allowed_token_ids]
        x = keep
    for word in p.bad_words_token_ids or []:
        if len(word) == 1 or output[-(len(word) - 1) :] == word[:-1] and len(output) >= len(word) - 1:
            x[word[-1]] = -math.inf
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | set(stop_ids):
            x[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        if t in output:
            x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def test_logits_processors_follow_vllms_formulas_in_float64():
    vocab, gen = 40, torch.Generator().manual_seed(0)
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.4),
        SamplingParams(logit_bias={3: 2.5, 7: -1.0}, min_tokens=5, stop_token_ids=[9]),
        SamplingParams(allowed_token_ids=[1, 2, 3, 5, 8, 13], repetition_penalty=0.7),
        SamplingParams(bad_words=["x"], frequency_penalty=2.0),
    ]
    params[3].bad_words_token_ids = [[4], [6, 2], [11, 12, 2]]
    prompts = [[1, 2, 3], [4, 5], [5, 5, 6], [7]]
    outputs = [[2, 2, 10, 3], [], [8, 1, 8], [11, 12]]
    history = TokenHistory(8, vocab, torch.device("cpu"))
    slots = [5, 0, 3, 7]
    for slot, prompt, output in zip(slots, prompts, outputs):
        history.reset(slot, prompt)
        for t in output:
            history.update(torch.tensor([slot]), torch.tensor([t]))
    rows = [0, 2, 3, 4]  # the batch has a fifth row (1) that changes nothing
    processors = build_logits_processors(rows, params, slots, history, stop_ids=[0])
    logits = torch.randn(5, vocab, generator=gen) * 3
    got = processors(logits)
    torch.testing.assert_close(got[1], logits[1])
    for row, p, prompt, output in zip(rows, params, prompts, outputs):
        want = reference_logits(logits[row], prompt, output, p, stop_ids=[0])
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want)), row
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[row][finite].double(), want[finite], rtol=1e-6, atol=1e-5)
    assert torch.isinf(got[4, 2]) and torch.isinf(got[4, 4]) and not torch.isinf(got[4, 6])  # [11, 12] -> 2 banned
    assert torch.isinf(got[2, 0]) and torch.isinf(got[2, 9])  # min_tokens: no stop token before 5 tokens


def test_apply_penalties_is_the_formula():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([[2, 1, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, False, True, False]])
    got = apply_penalties(logits, prompt, counts, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]))
    assert got.tolist() == [[2.0 / 2 - 0.5 - 0.5, -2.0 * 2 - 0.25 - 0.5, 0.5, 0.5]]


def test_min_tokens_holds_back_eos_and_stop_tokens(tiny, llm):
    _, _, ids = tiny
    eos, other = llm.llm_engine.config.eos_token_ids[0], 7
    for stop, extra in ((eos, {}), (other, dict(stop_token_ids=[other]))):  # a bias makes the stop token certain
        params = dict(temperature=0, max_tokens=40, logit_bias={stop: 100.0}, **extra)
        at_once = generate_ids(llm, ids, SamplingParams(**params))
        assert all(t == [stop] for t in at_once)
        for n in (1, 9):
            held = llm.generate(ids, SamplingParams(min_tokens=n, **params), use_tqdm=False)
            for o in held:
                assert len(o.outputs[0].token_ids) == n + 1 and o.outputs[0].token_ids[-1] == stop
                assert stop not in o.outputs[0].token_ids[:n] and o.outputs[0].finish_reason == "stop"


def test_min_tokens_past_int32_holds_eos_back_to_the_end_of_the_context(tiny, llm):
    "The processors hold min_tokens in int32: a larger one (2**40 here) once failed the step, and the engine with it."
    _, _, ids = tiny
    eos = llm.llm_engine.config.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=None, min_tokens=2**40, logit_bias={eos: 100.0})  # (eos: certain)
    for o in llm.generate(ids, params, use_tqdm=False):
        assert o.outputs[0].finish_reason == "length" and eos not in o.outputs[0].token_ids
        assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 128  # max_model_len
    assert generate_ids(llm, ids[:1], SamplingParams(temperature=0, max_tokens=3))  # the engine still runs


def test_logit_bias_allowed_token_ids_and_bad_words_in_the_engine(tiny, llm):
    tok, _, ids = tiny
    plain = generate_ids(llm, ids, SamplingParams(temperature=0, max_tokens=16))
    target = tok.encode(" return")[0]
    biased = generate_ids(llm, ids, SamplingParams(temperature=0, max_tokens=16, logit_bias={target: 100.0}))
    assert all(set(b) == {target} for b in biased)
    allowed = tok.encode(" a b c")
    sampled = generate_ids(llm, ids, SamplingParams(temperature=1.0, seed=0, max_tokens=16, allowed_token_ids=allowed))
    assert all(set(s) <= set(allowed) for s in sampled)
    word = tok.decode(plain[0][:3])  # the first three tokens of the first completion, banned as a bad word
    banned = generate_ids(llm, ids[:1], SamplingParams(temperature=0, max_tokens=16, bad_words=[word]))[0]
    assert banned[:2] == plain[0][:2] and banned[2] != plain[0][2]


PENALIZED = [
    SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.2),
    SamplingParams(temperature=0.9, seed=3, max_tokens=32, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=32, min_tokens=30, logit_bias={5: 3.0}),
    SamplingParams(temperature=0, max_tokens=32),
]


@pytest.fixture(scope="module")
def one_at_a_time(tiny):
    """Prompt i with PENALIZED[i], one request at a time: no batch-mates at all. (The test below sends each of these
    pairs twice in a batch, in both of its cases: their tokens alone are computed once.)"""
    _, _, ids = tiny
    with LLM(TINY_MODEL_PATH, max_model_len=128) as llm:
        return [generate_ids(llm, [p], sp)[0] for p, sp in zip(ids, PENALIZED, strict=True)]


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(num_kvcache_blocks=20, block_size=4, max_num_seqs=8, max_model_len=64)],
    ids=["plain", "preemption"],
)
def test_penalties_give_the_same_tokens_with_and_without_asynchronous_scheduling(tiny, one_at_a_time, kwargs):
    _, _, ids = tiny
    prompts, params = ids * 2, PENALIZED * 2
    results = []
    for async_scheduling in (False, True):
        with LLM(TINY_MODEL_PATH, async_scheduling=async_scheduling, **{"max_model_len": 128, **kwargs}) as llm:
            results.append(generate_ids(llm, prompts, params))
            if kwargs:
                assert llm.llm_engine.stats.num_preemptions > 0
    assert results[0] == results[1]
    assert one_at_a_time * 2 == results[0]  # (prompts, params) is the same 4 pairs twice


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_penalties_give_the_same_tokens_under_cuda_graphs_and_eager(tiny):
    _, _, ids = tiny
    prompts, params = ids * 8, PENALIZED * 8
    results = []
    for enforce_eager in (True, False):
        with LLM(
            TINY_MODEL_PATH, max_model_len=128, device="cuda", dtype="float32", enforce_eager=enforce_eager
        ) as llm:
            results.append(generate_ids(llm, prompts, params))
    assert results[0] == results[1]


def test_the_history_grows_and_slots_are_reused():
    cache = SamplingRegistry(torch.device("cpu"), vocab_size=32, stop_ids=[0])
    for i in range(20):
        cache.add(i, SamplingParams(repetition_penalty=1.2), prompt_token_ids=[i + 1])
    cache.batch(np.arange(20))
    assert len(cache.history) == 32 and sorted(cache.slots.values()) == list(range(20))
    assert all(cache.history.prompt_mask[cache.slots[i], i + 1] for i in range(20))  # kept through the growth
    cache.free(3)
    cache.add(20, SamplingParams(presence_penalty=1.0), prompt_token_ids=[5])
    cache.batch(np.array([20]))
    assert cache.slots[20] == 3 and len(cache.history) == 32
