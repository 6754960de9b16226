"""The latency benchmark's measurements (`python -m minivllm.bench --latency`), run small on the tiny model on a CPU."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from minivllm import LLM, TINY_MODEL_PATH
from minivllm.bench.latency import decode_step_table, latency_lines, single_stream


def test_single_stream_and_decode_step_table_on_the_tiny_model():
    spec = AutoConfig.from_pretrained(TINY_MODEL_PATH).to_dict()
    with LLM(TINY_MODEL_PATH, max_model_len=256) as llm:
        stream = single_stream(llm, spec, prompt_len=32, output_len=6)
        rows = decode_step_table(llm, spec, batches=(1, 3), context=24, steps=5, bandwidth=20e9, flops=1e11)
        assert not llm.llm_engine.scheduler.running and llm.llm_engine.trace is None  # nothing left, tracing off
    assert stream["output_tokens"] == 6 and stream["seconds"] > 0
    assert stream["output_tok_s"] == 6 / stream["seconds"] and 0 < stream["decode_step_ms"] < 1e3 * stream["seconds"]
    assert [r["batch"] for r in rows] == [1, 3]
    # the bound from first principles: at 20 GB/s and 1e11 FLOP/s this model's step is bandwidth-bound, so it is the
    # time to read its bfloat16 weights once (counted by transformers) and each sequence's 26 cached positions' K/V
    params = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH).num_parameters()
    head_dim = spec.get("head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    kv_per_position = spec["num_hidden_layers"] * 2 * spec["num_key_value_heads"] * head_dim * 2
    for r in rows:
        assert r["context"] == 24 and 1 <= r["steps"] <= 5 and 0 < r["host_ms"] <= r["step_ms"]
        by_hand = 1e3 * (2 * params + r["batch"] * 26 * kv_per_position) / 20e9
        assert r["bound_ms"] == pytest.approx(by_hand, rel=0.02)  # (the bound leaves out the norms' few weights)
    lines = latency_lines(stream, rows)
    assert len(lines) == 4 and "32-token prompt, 6 output tokens" in lines[0] and lines[2].split()[0] == "1"
