"""Log-probabilities as vLLM returns them (project issue 14): per position a dict token id -> Logprob(logprob, rank,
decoded_token) that includes the sampled (or, for prompt_logprobs, the actual) token; prompt log-probabilities
against transformers' logits, through chunked prefill and with the prefix cache holding the prompt."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, TINY_MODEL_PATH, Logprob, SamplingParams

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return", "import os\nimport sys\n\n"]


@pytest.fixture(scope="module")
def reference():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    ids = [tok.encode(p) for p in PROMPTS]
    with torch.no_grad():
        logprobs = [hf(torch.tensor([p])).logits[0].double().log_softmax(-1) for p in ids]
    return tok, ids, logprobs


def check_prompt_logprobs(out, ids, ref, k, tok):
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry, row, actual = out.prompt_logprobs[position], ref[position - 1], ids[position]
        assert next(iter(entry)) == actual and len(entry) in (k, k + 1)
        assert set(entry) == {actual} | set(row.topk(k).indices.tolist())
        for token, lp in entry.items():
            assert isinstance(lp, Logprob) and lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert lp.rank == 1 + int((row > row[token]).sum()) and lp.decoded_token == tok.decode([token])


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(max_num_batched_tokens=8, max_num_seqs=4)], ids=["one step", "chunked prefill"]
)
def test_prompt_logprobs_match_transformers(reference, kwargs):
    tok, ids, ref = reference
    with LLM(TINY_MODEL_PATH, max_model_len=128, **kwargs) as llm:
        for _ in range(2):  # the second time, the prompts' blocks are in the prefix cache: computed anyway
            outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3), use_tqdm=False)
            for out, p, r in zip(outs, ids, ref):
                check_prompt_logprobs(out, p, r, 3, tok)
                assert out.num_cached_tokens == 0
        plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert all(o.prompt_logprobs is None for o in plain)


def test_sampled_logprobs_are_logprob_objects_with_ranks(reference):
    tok, ids, _ = reference
    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    with LLM(TINY_MODEL_PATH, max_model_len=128) as llm:
        out = llm.generate(ids[:1], SamplingParams(temperature=1.0, seed=0, max_tokens=6, logprobs=2), use_tqdm=False)[
            0
        ].outputs[0]
    full = ids[0] + out.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([full])).logits[0].double().log_softmax(-1)[len(ids[0]) - 1 : -1]
    assert len(out.logprobs) == len(out.token_ids)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert next(iter(entry)) == token and entry[token].decoded_token == tok.decode([token])
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(ref[step, t]), abs=1e-4)
            assert lp.rank == 1 + int((ref[step] > ref[step, t]).sum())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    assert math.isfinite(out.cumulative_logprob)
