"""Structured outputs through the engine (issue 50): constrained and free requests in one batch, every finished
output validates, the free ones are token-identical to a run without constraints, bad specs are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_gguf import smollm2 as smollm2  # the real model, fetched once (a re-export of the fixture)

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.structured_outputs.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "size": {"type": "integer", "minimum": 0, "maximum": 9999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,3})\.[0-9]{2} (USD|EUR)"
CHOICE = ["def", "class", "import os", "return None"]
GRAMMAR = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-z] [a-z0-9_]{0,7}'
PROMPTS = ["def parse(text):\n", "import json\n", "class Point:\n", "# a comment\n", "x = [", "for i in range(3):\n"]


def check(kind: str, text: str) -> None:
    if kind == "json":  # (xgrammar's JSON strings may hold control characters other than newlines, as vLLM's)
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    elif kind == "choice":
        assert text in CHOICE
    else:
        assert re.fullmatch(REGEX if kind == "regex" else r"\[[a-z][a-z0-9_]{0,7}(,[a-z][a-z0-9_]{0,7}){0,3}\]", text)


SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICE),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


@pytest.fixture(scope="module")
def llm():
    llm = LLM(TINY_MODEL_PATH, max_num_seqs=64)
    yield llm
    llm.close()


def requests(n: int, seed_offset: int = 0) -> list[tuple[str, str, SamplingParams]]:
    "n constrained requests, the kinds in turn, sampled (temperature 0.8, a seed each) so that they differ."
    out = []
    for i in range(n):
        kind = list(SPECS)[i % 4]
        params = SamplingParams(temperature=0.8, seed=seed_offset + i, max_tokens=120, structured_outputs=SPECS[kind])
        out.append((kind, PROMPTS[i % len(PROMPTS)], params))
    return out


def test_a_hundred_constrained_requests_validate_beside_free_ones(llm):
    constrained = requests(100)
    free = [(p, SamplingParams(temperature=0, max_tokens=24)) for p in PROMPTS]
    prompts = [p for _, p, _ in constrained] + [p for p, _ in free]
    params = [s for _, _, s in constrained] + [s for _, s in free]
    outs = llm.generate(prompts, params)
    stopped = 0
    for (kind, _, _), out in zip(constrained, outs[:100], strict=True):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            stopped += 1
            check(kind, completion.text)
    assert stopped >= 95, stopped
    alone = llm.generate([p for p, _ in free], [s for _, s in free])
    assert [o.outputs[0].token_ids for o in outs[100:]] == [o.outputs[0].token_ids for o in alone]


def test_greedy_constrained_outputs_are_the_same_batched_or_alone(llm):
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec) for spec in SPECS.values()]
    together = llm.generate(PROMPTS[:4], params)
    for prompt, p, out in zip(PROMPTS[:4], params, together, strict=True):
        assert llm.generate(prompt, p)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(
        "x = ", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120, structured_outputs=SPECS["grammar"])
    )[0]
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        check("grammar", completion.text)


@pytest.mark.parametrize(
    "spec, error",
    [
        (dict(regex="[0-9"), "StructuredOutputsParams.regex cannot be compiled"),
        (dict(json={"type": "nonsense"}), "StructuredOutputsParams.json cannot be compiled"),
        (dict(grammar="root ::= foo"), "StructuredOutputsParams.grammar cannot be compiled"),
    ],
)
def test_a_bad_spec_refuses_its_call_and_leaves_the_engine_clean(llm, spec, error):
    good = SamplingParams(temperature=0, max_tokens=8)
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=re.escape(f"prompt 1: {error}")):
        llm.generate(["def f():", "import os"], [good, bad])
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("def f():", good)[0].outputs[0].text  # the next call works


def test_vllm_guided_decoding_name_is_the_same_field():
    p = SamplingParams(guided_decoding=StructuredOutputsParams(choice=["a", "b"]))
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(TypeError, match="structured_outputs must be StructuredOutputsParams or None"):
        SamplingParams(structured_outputs={"choice": ["a"]})


@pytest.mark.parametrize(
    "engine",
    [
        dict(num_kvcache_blocks=50, block_size=4, max_num_seqs=8, max_model_len=200),  # preemption and recompute
        dict(async_scheduling=True),  # no step planned ahead of a constrained one
        dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8),  # prompts cut in chunks
    ],
    ids=["preemption", "async", "chunked"],
)
def test_constrained_greedy_tokens_hold_under_engine_settings(engine):
    "Eight constrained greedy requests, the kinds in turn: the same tokens as the plain engine's, and valid."
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=s) for s in SPECS.values()] * 2
    prompts = [p * 8 for p in (PROMPTS * 2)[:8]]  # (long prompts: the 50 blocks cannot hold them all)
    with LLM(TINY_MODEL_PATH, device="cpu") as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(TINY_MODEL_PATH, device="cpu", **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if "num_kvcache_blocks" in engine:
            assert llm.llm_engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for kind, out in zip(list(SPECS) * 2, outs, strict=True):
        check(kind, out.outputs[0].text)


def test_a_stop_string_ends_a_constrained_request_early(llm):
    "A stop string cuts the constrained text where it appears (the grammar is not finished: no validation)."
    spec = StructuredOutputsParams(regex=r"alpha beta gamma delta")
    out = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=40, stop=[" gamma"], structured_outputs=spec))
    completion = out[0].outputs[0]
    assert completion.text == "alpha beta" and completion.finish_reason == "stop" and completion.stop_reason == " gamma"


@pytest.mark.slow
def test_the_real_model_keeps_a_hundred_constraints(smollm2):
    "SmolLM2-135M-Instruct (its own 49,152-token vocabulary and chat template): 100 constrained chat answers."
    with LLM(smollm2, device="cpu", max_num_seqs=100) as real:
        constrained = requests(100)
        conversations = [[{"role": "user", "content": prompt}] for _, prompt, _ in constrained]
        outs = real.chat(conversations, [s for _, _, s in constrained], use_tqdm=False)
    stopped = 0
    for (kind, _, _), out in zip(constrained, outs, strict=True):
        if out.outputs[0].finish_reason == "stop":
            stopped += 1
            check(kind, out.outputs[0].text)
    assert stopped >= 95, stopped
