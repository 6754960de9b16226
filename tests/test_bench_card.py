"""The benchmark's own rates (minivllm/bench/card.py), measured small on a CPU, and the bounds and fractions the
benchmark prints and keeps with them (the whole `python -m minivllm.bench` needs CUDA: these are its pieces)."""

from __future__ import annotations

import json

import pytest
import torch

from minivllm.bench import BenchResult, Report, environment, parse_args, roofline
from minivllm.bench.card import (
    H200_BANDWIDTH,
    H200_FLOPS,
    card_line,
    copy_bandwidth,
    cuda_versions,
    matmul_rate,
    measure_card,
    timed_ms,
)
from minivllm.bench.latency import latency_lines
from minivllm.bench.models import QWEN3_0_6B


def test_timed_ms_times_each_call_after_the_warmup():
    calls = []
    times = timed_ms(lambda: calls.append(1), "cpu", repeats=4, warmup=2)
    assert len(calls) == 6 and len(times) == 4 and all(t >= 0 for t in times)


def test_the_copy_and_the_product_on_a_cpu():
    copy = copy_bandwidth("cpu", nbytes=1 << 20, repeats=3)
    assert copy["bytes"] == 2 << 20 and copy["repeats"] == 3 and copy["ms"] > 0
    assert copy["bytes_per_s"] == pytest.approx(copy["bytes"] / copy["ms"] * 1e3)
    product = matmul_rate("cpu", n=64, repeats=3, warmup=1)
    assert product["flop"] == 2 * 64**3 and product["dtype"] == "bfloat16" and product["ms"] > 0
    assert product["flops"] == pytest.approx(product["flop"] / product["ms"] * 1e3)


def test_measure_card_and_its_line():
    peaks = measure_card("cpu", copy_bytes=1 << 20, matmul_n=64, repeats=3)
    assert peaks["bandwidth"] > 0 and peaks["flops"] > 0 and peaks["device"]
    assert peaks["bandwidth"] == peaks["copy"]["bytes_per_s"] and peaks["flops"] == peaks["matmul"]["flops"]
    h200 = dict(peaks, device="H200", bandwidth=H200_BANDWIDTH, flops=H200_FLOPS)
    assert card_line(h200).startswith("card: H200: copy 4.30 TB/s, bfloat16 matmul 64^3 790 TFLOP/s (medians of 3)")
    assert card_line(h200).endswith("= 100.0% and 100.0% of the H200's 4.3 TB/s and 790 TFLOP/s")


def test_the_environment_and_the_rates_flags():
    versions = cuda_versions()
    assert set(versions) >= {"driver", "cuda"} and versions["cuda"] == torch.version.cuda
    env = environment()
    assert {"python", "torch", "triton", "transformers"} <= set(env)
    if torch.cuda.is_available():
        assert {"gpu", "driver", "cuda"} <= set(env)
    args = parse_args([])
    assert args.bandwidth is None and args.flops is None  # measured on the card unless given
    args = parse_args(["--bandwidth", "3e12", "--flops", "7e14"])
    assert (args.bandwidth, args.flops) == (3e12, 7e14)


def test_a_run_against_both_bounds_and_the_results_file(capsys):
    lens, outs = [100, 200], [100, 100]
    peaks = measure_card("cpu", copy_bytes=1 << 20, matmul_n=64, repeats=3)
    bound = roofline(QWEN3_0_6B, lens, outs, 0.75 * H200_BANDWIDTH, H200_FLOPS)
    h200 = roofline(QWEN3_0_6B, lens, outs, H200_BANDWIDTH, H200_FLOPS)
    report = Report(model="tiny", environment=environment(), peaks=peaks)
    result = BenchResult("minivllm", "standard", 2, 300, 200, 0.5)
    report.add(result, bound, None, h200)
    line = capsys.readouterr().out
    run = json.loads(json.dumps(report.data))["runs"][0]
    assert run["fraction_of_bound"] == pytest.approx(400 / bound["max_output_tok_s"])
    assert run["fraction_of_h200_bound"] == pytest.approx(400 / h200["max_output_tok_s"])
    assert run["roofline_h200"] == h200 and run["fraction_of_bound"] > run["fraction_of_h200_bound"]
    assert f"{run['fraction_of_bound']:.1%} of the bound" in line
    assert f"{run['fraction_of_h200_bound']:.1%} at the H200's" in line
    saved = json.loads(json.dumps(report.data))
    assert saved["peaks"]["bandwidth"] > 0 and saved["peaks"]["flops"] > 0 and saved["peaks"]["matmul"]["n"] == 64
    report.add(result, bound)  # without the H200's bound: the line as before
    assert "H200" not in capsys.readouterr().out and "fraction_of_h200_bound" not in report.data["runs"][1]


def test_latency_lines_show_the_h200_bound_where_the_rows_have_it():
    stream = dict(
        prompt_tokens=1024, output_tokens=512, seconds=0.5, output_tok_s=1024.0, first_step_ms=4.8, decode_step_ms=0.92
    )
    row = dict(batch=1, context=1024, steps=64, step_ms=0.9, host_ms=0.3, bound_ms=0.45, h200_bound_ms=0.3)
    lines = latency_lines(stream, [row])
    assert lines[1].endswith("step / bound  H200 bound ms  step / H200's")
    assert lines[2].split()[-2:] == ["0.300", "3.0x"]
    old = {k: v for k, v in row.items() if k != "h200_bound_ms"}  # a results file from before: its table as it was
    assert latency_lines(stream, [old])[1].endswith("step / bound") and latency_lines(stream, [old])[2].endswith("2.0x")


def test_the_benchmark_says_it_needs_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark runs")
    from minivllm.bench import main

    assert main([]) == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_the_benchmark_takes_vllms_speculative_config(capsys):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert parse_args(["--speculative-config", json.dumps(spec)]).speculative_config == spec
    assert parse_args([]).speculative_config is None
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", "{method: ngram"])
    assert "--speculative-config" in capsys.readouterr().err


def test_an_8_bit_cache_bound_reads_one_byte_a_cached_number():
    from minivllm.bench.models import cache_bytes

    lens, outs = [256] * 64, [512] * 64
    wide = roofline(QWEN3_0_6B, lens, outs, H200_BANDWIDTH, H200_FLOPS)
    assert roofline(QWEN3_0_6B, lens, outs, H200_BANDWIDTH, H200_FLOPS, kv_bytes=2) == wide
    narrow = roofline(QWEN3_0_6B, lens, outs, H200_BANDWIDTH, H200_FLOPS, kv_bytes=cache_bytes("fp8"))
    assert narrow["prefill_s"] == wide["prefill_s"] and narrow["decode_s"] < wide["decode_s"]
    # each decode step: the weights' bytes, then the cache's, halved (every step here is bandwidth-bound)
    weights = roofline(QWEN3_0_6B, lens, outs, H200_BANDWIDTH, H200_FLOPS, kv_bytes=0)["decode_s"]
    assert narrow["decode_s"] - weights == pytest.approx((wide["decode_s"] - weights) / 2)
    assert [cache_bytes(d) for d in ("auto", "fp8", "fp8_e4m3", None)] == [None, 1, 1, None]
