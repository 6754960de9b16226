"""The serving benchmark (`python -m minivllm.bench serve`, notebook 13): its pure parts, its client against a
pretend server, and one run against `minivllm serve` on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest
from _net import health_server, wait_for

from minivllm import TINY_MODEL_PATH
from minivllm.bench.load import (
    RequestResult,
    keeps_up,
    percentile,
    poisson_arrivals,
    random_prompts,
    run_async,
    send_request,
    summarize,
)
from minivllm.bench.serve import parse_args, request_bodies, server_command
from minivllm.bench.servers import with_word_tokenizer


def test_poisson_arrivals_are_seeded_scaled_and_exponential():
    a = poisson_arrivals(50, 2.0, seed=3)
    assert a == poisson_arrivals(50, 2.0, seed=3) and a != poisson_arrivals(50, 2.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert np.allclose(poisson_arrivals(50, 4.0, seed=3), np.array(a) / 2)  # the same stream, twice as fast
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    gaps = np.diff(poisson_arrivals(20_000, 5.0, seed=0))
    assert abs(gaps.mean() - 0.2) < 0.01 and abs(gaps.std() - 0.2) < 0.01  # exponential: std = mean = 1 / rate
    assert abs(np.mean(gaps < 0.1) - (1 - math.exp(-0.5))) < 0.02


def test_percentile_is_numpys_linear_interpolation():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = list(rng.exponential(size=n))
        for p in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    assert percentile([], 50) is None and percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_random_prompts_skip_special_tokens():
    prompts = random_prompts(4, 100, vocab_size=10, seed=0, skip={0, 1})
    assert [len(p) for p in prompts] == [100] * 4 and {t for p in prompts for t in p} == set(range(2, 10))
    assert prompts == random_prompts(4, 100, vocab_size=10, seed=0, skip={0, 1})


def make(sent_at, ttft, e2e, tokens=4, itl=(0.01, 0.01, 0.01), error=None):
    return RequestResult(sent_at=sent_at, ttft=ttft, itl=list(itl), e2e=e2e, output_tokens=tokens, error=error)


def test_summarize_counts_failures_and_takes_percentiles_of_the_completed():
    results = [
        make(0.0, 0.02, 0.05),
        make(0.5, 0.04, 0.07),
        make(1.0, 0.03, 0.09, tokens=3, itl=(0.02, 0.04)),
        RequestResult(sent_at=1.5, error="HTTP 503: busy"),
    ]
    s = summarize(results, duration=2.0, rate=2.0)
    assert (s["num_requests"], s["completed"], s["failed"], s["output_tokens"]) == (4, 3, 1, 11)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 5.5
    assert s["p50_ttft_ms"] == pytest.approx(30) and s["mean_e2e_ms"] == pytest.approx(70)
    assert s["p50_itl_ms"] == pytest.approx(10) and s["p99_itl_ms"] == pytest.approx(
        1e3 * np.percentile([0.01] * 6 + [0.02, 0.04], 99)
    )
    assert s["mean_tpot_ms"] == pytest.approx(1e3 * np.mean([0.03 / 3, 0.03 / 3, 0.06 / 2]))
    assert s["kept_up"] is False and s["errors"] == ["HTTP 503: busy"]  # a failed request: not kept up
    assert summarize(results[:3], 2.0, math.inf)["kept_up"] is None
    empty = summarize([RequestResult(error="x")], 1.0, 1.0)
    assert empty["completed"] == 0 and empty["p99_ttft_ms"] is None and empty["mean_itl_ms"] is None


def test_keeps_up_sees_a_growing_queue():
    steady = [make(i * 0.5, 0.03 + 0.01 * (i % 3), 0.1) for i in range(12)]
    growing = [make(i * 0.5, 0.03 + 0.4 * i, 0.5 + 0.4 * i) for i in range(12)]
    assert keeps_up(steady) and not keeps_up(growing) and not keeps_up([])
    all_at_once = [make(0.01 * i, 0.03, 2.0) for i in range(12)]  # every request sent before the first finished
    assert keeps_up(all_at_once) is None and summarize(all_at_once, 2.2, 100.0)["kept_up"] is None


class Events(httpx.AsyncByteStream):
    def __init__(self, events: list, done: bool = True):
        self.events, self.done = events, done

    async def __aiter__(self):
        for event in self.events:
            await asyncio.sleep(0.01)
            yield f"data: {json.dumps(event)}\n\n".encode()
        if self.done:
            yield b"data: [DONE]\n\n"


def ask(response: httpx.Response) -> RequestResult:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: response)) as client:
            return await send_request(client, "http://test/v1/completions", {"prompt": [1]}, 0.0)

    return run_async(go())


def text(t: str, **more) -> dict:
    return {"choices": [{"index": 0, "text": t}], **more}


def test_send_request_reads_minivllm_and_transformers_streams():
    minivllm = [
        text("a"),
        text(""),
        text("b"),
        text("c"),
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
    ]
    r = ask(httpx.Response(200, stream=Events(minivllm)))
    assert r.ok and r.output_tokens == 4 and r.prompt_tokens == 5 and len(r.itl) == 2 and r.ttft < r.e2e
    transformers = [
        text("a"),
        text("b"),
        {
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        },
    ]
    r = ask(httpx.Response(200, stream=Events(transformers, done=False)))  # (no [DONE])
    assert r.ok and r.output_tokens == 2 and len(r.itl) == 1
    counted = [text("a", usage={"completion_tokens": 1}), text("bcd", usage={"completion_tokens": 4})]
    r = ask(httpx.Response(200, stream=Events(counted)))  # usage in every chunk: the gap shared by 3 tokens
    assert r.output_tokens == 4 and len(r.itl) == 3 and r.itl[0] == r.itl[1] == r.itl[2]
    assert ask(httpx.Response(200, stream=Events([text("a")]))).output_tokens == 1  # no usage: chunks counted


def test_send_request_failures():
    assert ask(httpx.Response(422, json={"detail": "nope"})).error.startswith("HTTP 422")
    r = ask(httpx.Response(200, stream=Events([text("a"), {"error": {"message": "engine died"}}])))
    assert not r.ok and "engine died" in r.error
    assert ask(httpx.Response(200, stream=Events([]))).error == "the stream ended without a token"


def test_requests_and_server_commands_per_backend():
    args = parse_args(
        [
            "--backend",
            "minivllm",
            "transformers",
            "--device",
            "cuda",
            "--transformers-args",
            "--cb-block-size 32",
            "--output-len",
            "7",
        ]
    )
    assert server_command(args, "minivllm", "M", 8000)[1:] == [
        "-m",
        "minivllm",
        "serve",
        "M",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--device",
        "cuda",
    ]
    assert server_command(args, "transformers", "M", 1)[-5:] == [
        "--continuous-batching",
        "--device",
        "cuda",
        "--cb-block-size",
        "32",
    ]
    body = request_bodies(args, "minivllm", [[1, 2]])[0]
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 7 and body["ignore_eos"] and body["stream"]
    body = request_bodies(args, "transformers", [[1, 2]])[0]
    assert "ignore_eos" not in body and json.loads(body["generation_config"]) == {"eos_token_id": -1}
    plain = parse_args(["--backend", "openai", "--base-url", "http://x", "--no-ignore-eos", "--extra-body", '{"a": 1}'])
    assert set(request_bodies(plain, "openai", [[1]])[0]) == {
        "prompt",
        "max_tokens",
        "temperature",
        "stream",
        "stream_options",
        "a",
    }
    with pytest.raises(SystemExit):
        parse_args(["--backend", "openai"])  # neither a URL nor a command


def test_word_tokenizer_round_trips_token_ids(tmp_path):
    from transformers import AutoTokenizer

    folder = with_word_tokenizer(TINY_MODEL_PATH, str(tmp_path / "words"))
    assert os.path.islink(os.path.join(folder, "model.safetensors"))
    words = AutoTokenizer.from_pretrained(folder)
    ids = random_prompts(1, 50, len(words), seed=0)[0]
    assert len(words) == 4096 and words.encode(words.decode(ids)) == ids


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.timeout(90)
def test_bench_serve_against_minivllm_serve_on_the_tiny_model(tmp_path, capsys):
    from minivllm.bench import main

    out = tmp_path / "serve.json"
    rc = main(
        [
            "serve",
            "--model",
            TINY_MODEL_PATH,
            "--device",
            "cpu",
            "--request-rate",
            "4",
            "--num-prompts",
            "5",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--warmup",
            "1",
            "--server-log",
            str(tmp_path / "{backend}.log"),
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert rc == 0 and (run["backend"], run["request_rate"], run["completed"], run["failed"]) == ("minivllm", "4", 5, 0)
    assert run["output_tokens"] == 40 and all(r["prompt_tokens"] == 16 for r in run["requests"])
    assert 0 < run["p50_ttft_ms"] <= run["p99_ttft_ms"] and run["p50_e2e_ms"] >= run["p50_ttft_ms"]
    assert report["command"].startswith("python -m minivllm.bench serve --model") and "torch" in report["environment"]
    port = int(report["servers"][0]["server_cmd"].split("--port ")[1].split()[0])
    assert port_is_free(port)  # the server was stopped
    assert "minivllm" in capsys.readouterr().out


@pytest.mark.timeout(90)
def test_sigterm_stops_the_server_and_keeps_the_results(tmp_path):
    log, out = tmp_path / "minivllm.log", tmp_path / "serve.json"
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minivllm.bench",
            "serve",
            "--model",
            TINY_MODEL_PATH,
            "--device",
            "cpu",
            "--request-rate",
            "0.5",
            "--num-prompts",
            "50",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--server-log",
            str(log),
            "--out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
    )
    wait_for(
        lambda: "POST /v1/completions" in (log.read_text() if log.exists() else ""),
        120,
        "the bench's first request in the server's log",
        interval=0.2,
    )
    port = int(re.search(r"http://127.0.0.1:(\d+)", log.read_text()).group(1))
    bench.send_signal(signal.SIGTERM)  # (as `timeout` does): the server goes too, and the JSON is written
    assert bench.wait(40) == 143 and port_is_free(port)
    assert json.loads(out.read_text())["servers"][0]["backend"] == "minivllm"


@pytest.mark.timeout(120)
def test_a_port_taken_before_the_server_binds_it_moves_the_server_to_another(tmp_path, monkeypatch):
    import socket

    from minivllm.bench import servers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        ports = iter([taken.getsockname()[1], servers.free_port()])
        monkeypatch.setattr(servers, "free_port", lambda: next(ports))
        log, tried = tmp_path / "server.log", []

        def command(port):
            tried.append(port)
            return health_server(port)

        with servers.server_on_free_port(command, str(log), startup_timeout=60) as url:
            assert servers.healthy(url) and url.endswith(f":{tried[-1]}")
        assert len(tried) == 2 and tried[0] == taken.getsockname()[1]
        assert "address already in use" in log.read_text().lower()
        with pytest.raises(servers.PortTaken, match="(?i)address already in use"):  # every port taken
            monkeypatch.setattr(servers, "free_port", lambda: taken.getsockname()[1])
            with servers.server_on_free_port(command, str(log), startup_timeout=60, tries=2):
                pass
