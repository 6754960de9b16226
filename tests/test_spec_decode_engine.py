"""Speculative decoding in the engine (notebooks/deep_dives/10_speculative_decoding.ipynb): n-gram proposals and a
draft model's, verified by the target model, give greedy outputs token-identical to the same engine without
speculation, on batches of mixed prompt lengths, with max_tokens, stop tokens, eos and stop strings inside an accepted
run, under preemption, with prefix caching, chunked prefill and asynchronous scheduling; seeded sampling is
reproducible; the draft's kept cache proposes what a fresh draft would; what the engine cannot speculate for yet is
refused by name; structured outputs check every guess."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import time

import pytest
from _spec_prompts import PROMPTS, SPEC
from prometheus_client import CollectorRegistry

import minivllm.spec_decode.speculator as speculator
from minivllm import LLM, TINY_DRAFT_PATH, TINY_MODEL_PATH, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.async_llm import AsyncLLM
from minivllm.entrypoints.cli import engine_kwargs, parse_serve_args
from minivllm.entrypoints.metrics import EngineMetrics
from minivllm.structured_outputs.params import StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def run(prompts, params, speculative: bool = True, spec: dict = SPEC, **kwargs) -> tuple[list, LLMEngine]:
    llm = LLM(TINY_MODEL_PATH, device="cpu", speculative_config=spec if speculative else None, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    engine.scheduler.check_invariants()
    assert not engine.scheduler.running and not engine.scheduler.block_manager.check_invariants()
    return outputs, engine


def completions(outputs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for out in outputs for c in out.outputs]


SETTINGS = {
    "default (async scheduling, prefix caching)": dict(),
    "no async scheduling": dict(async_scheduling=False),
    "no prefix caching": dict(enable_prefix_caching=False),
    "chunked prefill": dict(max_num_batched_tokens=8, max_num_seqs=4),
    "preemption": dict(num_kvcache_blocks=24, block_size=4, max_num_seqs=7, max_model_len=96),
    "block size 1": dict(block_size=1, max_model_len=128),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_greedy_outputs_match_the_engine_without_speculation(name):
    kwargs = SETTINGS[name]
    plain, _ = run(PROMPTS, GREEDY, speculative=False, **kwargs)
    spec, engine = run(PROMPTS, GREEDY, **kwargs)
    assert completions(spec) == completions(plain)
    stats = engine.stats
    assert stats.num_spec_accepted_tokens > 0 and stats.num_spec_draft_tokens >= stats.num_spec_accepted_tokens
    assert stats.num_generated_tokens == sum(len(c[0]) for c in completions(spec))
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if name.startswith("default"):
        assert stats.num_steps < len(PROMPTS) * GREEDY.max_tokens // 2 + 1  # fewer steps than tokens per request


def test_verify_steps_laid_out_as_prompt_chunks_give_the_same_tokens(monkeypatch):
    "Verify steps of more rows than VERIFY_DECODE_MAX_ROWS are laid out as prompt chunks: the same greedy tokens."
    import minivllm.engine.batch_builder as bb

    plain, _ = run(PROMPTS, GREEDY, speculative=False)
    monkeypatch.setattr(bb, "VERIFY_DECODE_MAX_ROWS", 0)
    built = []
    prepare = bb.prepare_verify
    monkeypatch.setattr(bb, "prepare_verify", lambda *a: built.append(a[-1]) or prepare(*a))
    spec, engine = run(PROMPTS, GREEDY)
    assert completions(spec) == completions(plain)
    assert built and not any(built) and engine.stats.num_spec_accepted_tokens > 0


def test_requests_whose_guesses_keep_failing_back_off(monkeypatch):
    """Every guess rejected: a request verifies guesses at its first two decodes, then after 8, 16, 32 ... tokens,
    its other steps planned ahead as plain decoding's; the next request starts where the engine's misses stand."""
    import numpy as np

    import minivllm.spec_decode.verify as verify
    from minivllm.spec_decode.ngram import NgramProposer

    def always_three(self, histories, max_k=None):  # three guesses for every decode (the last token, repeated)
        return [[int(h[-1])] * min(3, m) for h, m in zip(histories, max_k)]

    accept = verify.accept_greedy
    monkeypatch.setattr(NgramProposer, "propose", always_three)
    monkeypatch.setattr(verify, "accept_greedy", lambda d, c, t: accept(np.full_like(d, -1), c, t))
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain, _ = run(PROMPTS[:1], params, speculative=False)
    llm = LLM(TINY_MODEL_PATH, device="cpu", speculative_config=SPEC)
    proposals = []
    propose = speculator.Speculator.propose
    monkeypatch.setattr(speculator.Speculator, "propose", lambda self: proposals.append(1) or propose(self))
    for request in range(2):
        trace = llm.llm_engine.start_trace()
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert completions(out) == completions(plain)
        verified = [i for i, r in enumerate(r for r in trace if r.is_decode_only) if r.num_emitted is not None]
        assert verified == ([0, 1, 10, 27, 60] if request == 0 else [0])  # (decode steps 0-63: tokens 1-64)
    assert llm.llm_engine.stats.num_spec_accepted_tokens == 0
    assert len(proposals) < 20  # (between guesses, steps are planned ahead: no proposal round each)


def test_max_tokens_cut_inside_accepted_runs():
    params = [dataclasses.replace(GREEDY, max_tokens=m) for m in range(1, 25)]
    prompts = [PROMPTS[0]] * len(params)
    plain, _ = run(prompts, params, speculative=False)
    spec, engine = run(prompts, params)
    assert completions(spec) == completions(plain)
    assert [len(c[0]) for c in completions(spec)] == list(range(1, 25))
    assert engine.stats.num_spec_accepted_tokens > 0


def test_stop_tokens_eos_and_stop_strings_inside_accepted_runs(monkeypatch):
    # (its requests come one after another and most of the tiny model's guesses fail: the engine would stop guessing)
    monkeypatch.setattr(speculator, "BACKOFF_AFTER", 10**9)
    reference, _ = run(PROMPTS[:1], GREEDY, speculative=False)
    tokens, text = reference[0].outputs[0].token_ids, reference[0].outputs[0].text
    firsts = [t for i, t in enumerate(tokens) if 2 <= i == tokens.index(t)]  # tokens first seen after two others
    stops = sorted({text[i : i + 3] for i in range(4, len(text) - 3, 5) if text[i : i + 3].strip()})
    params = [dataclasses.replace(GREEDY, stop_token_ids=[t]) for t in firsts]
    params += [dataclasses.replace(GREEDY, stop=[s]) for s in stops]
    params += [dataclasses.replace(GREEDY, ignore_eos=False)] * len(firsts)  # eos: one of the first-seen tokens
    prompts = [PROMPTS[0]] * len(params)
    results = []
    for speculative in (False, True):
        llm = LLM(TINY_MODEL_PATH, device="cpu", speculative_config=SPEC if speculative else None)
        engine = llm.llm_engine
        outputs = []
        for eos in firsts:  # the eos requests one eos id at a time
            engine.scheduler.eos_token_ids = frozenset([eos])
            outputs += llm.generate(prompts[:1], params[-1], use_tqdm=False)
        engine.scheduler.eos_token_ids = frozenset()
        outputs += llm.generate(prompts[: -len(firsts)], params[: -len(firsts)], use_tqdm=False)
        results.append((completions(outputs), engine.stats))
    (plain, _), (spec, stats) = results
    assert spec == plain
    assert stats.num_spec_accepted_tokens > 0
    assert sum(c[2] == "stop" for c in spec) == len(spec)  # every request stopped early, none by length
    assert len(firsts) >= 3 and len(stops) >= 3


def test_seeded_sampling_is_reproducible():
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, ignore_eos=True)
    params = [dataclasses.replace(sampled, seed=i) for i in range(len(PROMPTS))]
    first, engine = run(PROMPTS, params, seed=3)
    again, _ = run(PROMPTS, params, seed=4)  # seeded requests: the engine's seed does not matter
    assert completions(first) == completions(again)
    assert engine.stats.num_spec_draft_tokens > 0
    unseeded, _ = run(PROMPTS, sampled, seed=3)
    unseeded_again, _ = run(PROMPTS, sampled, seed=3)
    assert completions(unseeded) == completions(unseeded_again)


def test_logprobs_and_n_greater_than_one():
    params = [dataclasses.replace(GREEDY, logprobs=2), dataclasses.replace(GREEDY, n=2)]
    prompts = PROMPTS[:2]
    plain, _ = run(prompts, params, speculative=False)
    spec, _ = run(prompts, params)
    assert completions(spec) == completions(plain)
    for got, want in zip(spec[0].outputs[0].logprobs, plain[0].outputs[0].logprobs):
        assert got.keys() == want.keys()
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-4)
    assert spec[0].outputs[0].cumulative_logprob == pytest.approx(plain[0].outputs[0].cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(speculative_config={"model": "drafts/x", "num_speculative_tokens": 2}),
            "'drafts/x' is not a model folder",
        ),
        (
            dict(speculative_config={"model": TINY_DRAFT_PATH, "num_speculative_tokens": 2}, tensor_parallel_size=2),
            "tensor",
        ),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, tensor_parallel_size=2), "tensor"),
        (dict(speculative_config={"method": "ngram"}), "num_speculative_tokens must be an integer"),
    ],
)
def test_unsupported_configurations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(TINY_MODEL_PATH, device="cpu", **kwargs)


LOGITS_CHANGES = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.8),
    dict(frequency_penalty=0.5),
    dict(logit_bias={16: 5.0, 264: -3.0}),
    dict(min_tokens=8, ignore_eos=False, stop_token_ids=[16]),
    dict(bad_words=["count += x", " the"]),
    dict(allowed_token_ids=list(range(400))),
]


def test_logits_processors_see_the_earlier_guesses_of_their_step():
    "Each row of a speculating sequence is processed with its earlier guesses in the history, as one step each."
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    params = [dataclasses.replace(GREEDY, **change) for change in LOGITS_CHANGES for _ in prompts]
    plain, _ = run(prompts * len(LOGITS_CHANGES), params, speculative=False)
    spec, engine = run(prompts * len(LOGITS_CHANGES), params)
    assert completions(spec) == completions(plain)
    assert engine.stats.num_spec_accepted_tokens > 0
    sampled = [dataclasses.replace(p, temperature=0.8, seed=i) for i, p in enumerate(params)]
    first, _ = run(prompts * len(LOGITS_CHANGES), sampled)
    again, _ = run(prompts * len(LOGITS_CHANGES), sampled)
    assert completions(first) == completions(again)


CONSTRAINED = {
    "regex": (StructuredOutputsParams(regex="(ab ){8}c"), lambda t: re.fullmatch("(ab ){8}c", t)),
    "choice": (StructuredOutputsParams(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
    "json": (
        StructuredOutputsParams(json={"type": "array", "items": {"enum": [1, 2]}, "minItems": 6, "maxItems": 6}),
        lambda t: len(json.loads(t)) == 6 and set(json.loads(t)) <= {1, 2},
    ),
    "code": (StructuredOutputsParams(regex=r"(for i in range\(10\):\n    print\(i\)\n){2}"), bool),
}


def test_structured_outputs_match_the_engine_without_speculation():
    "Constrained and free requests in one batch: each guess checked against its grammar, every row masked."
    constrained = [
        dataclasses.replace(GREEDY, ignore_eos=False, max_tokens=48, structured_outputs=c)
        for c, _ in CONSTRAINED.values()
    ]
    params = constrained + [GREEDY] * 3
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[6], PROMPTS[2], PROMPTS[4], PROMPTS[5]]
    plain, _ = run(prompts, params, speculative=False)
    spec, engine = run(prompts, params)
    assert completions(spec) == completions(plain)
    assert engine.stats.num_spec_accepted_tokens > 0
    for out, (_, check) in zip(spec, CONSTRAINED.values()):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text
    only, engine = run(prompts[:4], constrained)  # the constrained rows alone also accept guesses
    assert completions(only) == completions(spec)[:4]
    assert engine.stats.num_spec_accepted_tokens > 0
    sampled = [dataclasses.replace(p, temperature=1.0, seed=i) for i, p in enumerate(constrained)]
    for out, (_, check) in zip(run(prompts[:4], sampled)[0], CONSTRAINED.values()):
        assert out.outputs[0].finish_reason != "stop" or check(out.outputs[0].text), out.outputs[0].text


def test_acceptance_is_exported_under_vllms_metric_names():
    llm = AsyncLLM(TINY_MODEL_PATH, device="cpu", speculative_config=SPEC)
    try:
        registry = CollectorRegistry()
        EngineMetrics(llm, registry, "tiny")

        async def generate():
            return [out async for out in llm.generate(PROMPTS[0], GREEDY, "r0")]

        outs = asyncio.run(generate())
        assert len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens

        def value(name: str) -> float:
            return registry.get_sample_value(f"vllm:spec_decode_{name}_total", {"model_name": "tiny"})

        deadline = time.monotonic() + 30  # (the engine thread records a step after handing its outputs on: poll)
        while value("num_accepted_tokens") != llm.engine.stats.num_spec_accepted_tokens and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = llm.engine.stats
        assert value("num_drafts") == stats.num_spec_drafts > 0
        assert value("num_draft_tokens") == stats.num_spec_draft_tokens
        assert value("num_accepted_tokens") == stats.num_spec_accepted_tokens > 0
    finally:
        llm.shutdown()


def test_serve_takes_vllms_speculative_config_flag(capsys):
    args = parse_serve_args([TINY_MODEL_PATH, "--speculative-config", json.dumps(SPEC)])
    assert engine_kwargs(args)["speculative_config"] == SPEC
    assert "speculative_config" not in engine_kwargs(parse_serve_args([TINY_MODEL_PATH]))
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            parse_serve_args([TINY_MODEL_PATH, "--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err


DRAFT = {"method": "draft_model", "model": TINY_DRAFT_PATH, "num_speculative_tokens": 3}


@pytest.mark.parametrize("name", ["default (async scheduling, prefix caching)", "preemption"])
def test_draft_model_greedy_outputs_match_the_engine_without_speculation(name):
    kwargs = SETTINGS[name]
    plain, _ = run(PROMPTS, GREEDY, speculative=False, **kwargs)
    spec, engine = run(PROMPTS, GREEDY, spec=DRAFT, **kwargs)
    assert completions(spec) == completions(plain)
    stats, proposer = engine.stats, engine.speculator.proposer
    assert stats.num_spec_accepted_tokens > 0 and stats.num_spec_draft_tokens >= stats.num_spec_accepted_tokens
    assert stats.num_generated_tokens == sum(len(c[0]) for c in completions(spec))
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0
    assert not proposer.states and len(proposer.free_blocks) == engine.scheduler.block_manager.num_blocks


def test_the_drafts_kept_cache_proposes_what_a_fresh_draft_would():
    "The draft's guesses are its own greedy tokens, also after a verify step rolled its cache back."
    from minivllm.engine.sequence import Sequence
    from minivllm.engine_args import EngineArgs
    from minivllm.spec_decode.config import SpeculativeConfig
    from minivllm.spec_decode.draft import DraftModelProposer

    own = LLM(TINY_DRAFT_PATH, device="cpu")
    prompt = own.get_tokenizer().encode(PROMPTS[2])
    [out] = own.generate({"prompt_token_ids": prompt}, dataclasses.replace(GREEDY, max_tokens=8), use_tqdm=False)
    engine = EngineArgs(TINY_MODEL_PATH, device="cpu", block_size=4).resolve()
    proposer = DraftModelProposer(SpeculativeConfig.from_dict(DRAFT), engine, num_blocks=32)
    assert proposer.propose([prompt]) == [list(out.outputs[0].token_ids[:3])] and len(proposer.free_blocks) == 32
    seq = Sequence(list(prompt), GREEDY, 4, seq_id=0)
    [guesses] = proposer.propose([seq.token_ids], [3], [seq])
    seq.token_ids += guesses[:1] + [5]  # one guess accepted, then a token of the target's that the draft never saw
    [again] = proposer.propose([seq.token_ids], [3], [seq])
    assert again == proposer.propose([list(seq.token_ids)])[0]
    assert proposer.states[0].tokens == seq.token_ids + again[:2]
    proposer.keep_only([])
    assert not proposer.states and len(proposer.free_blocks) == 32


def test_draft_model_seeded_sampling_is_reproducible():
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True)
    params = [dataclasses.replace(sampled, seed=i) for i in range(4)]
    first, engine = run(PROMPTS[:4], params, spec=DRAFT, seed=3)
    again, _ = run(PROMPTS[:4], params, spec=DRAFT, seed=4)  # seeded requests: the engine's seed does not matter
    assert completions(first) == completions(again)
    assert engine.stats.num_spec_accepted_tokens > 0


def test_a_draft_of_another_vocabulary_is_refused(tmp_path):
    folder = shutil.copytree(TINY_DRAFT_PATH, tmp_path / "draft")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 4000}))
    with pytest.raises(ValueError, match="vocabulary of 4000 tokens, the target 4096"):
        LLM(TINY_MODEL_PATH, device="cpu", speculative_config={**DRAFT, "model": str(folder)})
