"""The latency benchmark's measurements (`python -m minivllm.bench --latency`), run small on the tiny model on a CPU."""

from __future__ import annotations

from transformers import AutoConfig

from minivllm import LLM, TINY_MODEL_PATH
from minivllm.bench.latency import decode_step_table, latency_lines, single_stream
from minivllm.bench.models import roofline


def test_single_stream_and_decode_step_table_on_the_tiny_model():
    spec = AutoConfig.from_pretrained(TINY_MODEL_PATH).to_dict()
    with LLM(TINY_MODEL_PATH, max_model_len=256) as llm:
        stream = single_stream(llm, spec, prompt_len=32, output_len=6)
        rows = decode_step_table(llm, spec, batches=(1, 3), context=24, steps=5, bandwidth=20e9, flops=1e11)
        assert not llm.llm_engine.scheduler.running and llm.llm_engine.trace is None  # nothing left, tracing off
    assert stream["output_tokens"] == 6 and stream["seconds"] > 0
    assert stream["output_tok_s"] == 6 / stream["seconds"] and 0 < stream["decode_step_ms"] < 1e3 * stream["seconds"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["context"] == 24 and 1 <= r["steps"] <= 5 and 0 < r["host_ms"] <= r["step_ms"]
        bound = roofline(spec, [24 + 2] * r["batch"], [1] * r["batch"], 20e9, 1e11)["decode_s"]
        assert r["bound_ms"] == 1e3 * bound
    lines = latency_lines(stream, rows)
    assert len(lines) == 4 and "32-token prompt, 6 output tokens" in lines[0] and lines[2].split()[0] == "1"
