"""Real clients nobody here wrote, run against `minivllm serve` on the embedded tiny Qwen3 (float32, CPU; issue 49).

- lm-evaluation-harness 0.4.13 (`python -m lm_eval run`) scores a local multiple-choice task (tests/data/code_mc.yaml
  and its five questions in code_mc.jsonl: no download) twice: `--model local-completions` against the server and
  `--model hf` on the same model folder. With `--log_samples`, every answer's log-likelihood agrees within 1e-4, and
  so do the greedy flags and the answer each picks.
- guidellm 0.8.1 (`python -m guidellm run`) runs the benchmark of the issue for each request format (constant rate 2,
  8 s, synthetic prompts of 64 tokens, 32 output tokens; the tiny model's folder as its tokenizer): no request errs,
  some complete, each completed request's prompt tokens are what the server's /tokenize counts for its body and its
  output tokens are the 32 asked for, and the server's /metrics counted the same requests and tokens.
Both run as subprocesses, offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), with a deadline on every wait.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from _net import start_server
from prometheus_client.parser import text_string_to_metric_families

from minivllm import TINY_MODEL_PATH

pytestmark = pytest.mark.slow

MODEL = "tiny"
DATA = Path(__file__).parent / "data"
TASK = "minivllm_code_mc"
GUIDELLM_SECONDS = 8  # (about 16 requests at rate 2: each is checked one by one)
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32
CLIENT_DEADLINE = 300  # seconds for one client run (most of it is importing torch and friends on a busy machine)


def client_env(tmp_path: Path) -> dict:
    """Offline, one thread a process, caches in tmp_path; guidellm with 2 worker processes (its default of 10 each
    import torch: slow on 2 cores)."""
    return os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "GUIDELLM__MAX_WORKER_PROCESSES": "2",
    }


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def start(args: list[str], log: Path, **kwargs) -> subprocess.Popen:
    "A subprocess in a session of its own (its children can be ended with it), its output in `log`."
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    "Signal the process and its session; SIGKILL them if they are not gone within 30 s."
    for signum in (sig, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
            return


def finish(proc: subprocess.Popen, log: Path, what: str, timeout: float = CLIENT_DEADLINE) -> None:
    "Wait for a client to exit 0; fail with the end of its log if it does not, or not within `timeout` seconds."
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError(f"{what} did not finish within {timeout} s:\n{tail(log)}") from None
    assert code == 0, f"{what} exited with {code}:\n{tail(log)}"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    "`python -m minivllm serve` on the tiny model (float32, CPU) on a free port, for the module."
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [sys.executable, "-m", "minivllm", "serve", TINY_MODEL_PATH, "--device", "cpu", "--dtype", "float32"]
    args += ["--served-model-name", MODEL, "--log-level", "warning"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc, url = start_server(lambda port: [*args, "--port", str(port)], log, 120, env=env)
    try:
        yield Server(url, proc)
    finally:
        stop(proc, signal.SIGTERM)


# ------------------------------------------------------------------------------------------------------- lm-eval
def lm_eval_args(model: str, model_args: list[str], out: Path) -> list[str]:
    return [
        *[sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", *model_args],
        *["--tasks", TASK, "--include_path", ".", "--output_path", str(out), "--log_samples"],
    ]


def samples(out: Path) -> list[dict]:
    "lm-eval's logged samples of the task (one JSON line per question), by doc_id."
    (path,) = out.glob(f"*/samples_{TASK}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def scores(sample: dict) -> list[tuple[float, bool]]:
    "Each choice's (log-likelihood, greedy) as lm-eval logged it (as strings)."
    return [(float(ll), greedy == "True") for ((ll, greedy),) in sample["resps"]]


@pytest.mark.timeout(2 * CLIENT_DEADLINE + 60)
def test_lm_eval_local_completions_matches_its_hf_backend(server, tmp_path):
    task = tmp_path / "task"  # the task files, where lm-eval runs (its data_files path is relative)
    task.mkdir()
    for name in ("code_mc.yaml", "code_mc.jsonl"):
        shutil.copy(DATA / name, task)
    served_args = [f"model={MODEL}", f"base_url={server.url}/v1/completions", f"tokenizer={TINY_MODEL_PATH}"]
    served_args += ["tokenizer_backend=huggingface", "num_concurrent=1", "max_retries=1"]
    runs = {  # both at once: the hf backend needs no server
        "local-completions": lm_eval_args("local-completions", served_args, tmp_path / "local-completions"),
        "hf": [
            *lm_eval_args("hf", [f"pretrained={TINY_MODEL_PATH}", "dtype=float32"], tmp_path / "hf"),
            "--device",
            "cpu",
        ],
    }
    env = client_env(tmp_path)
    procs = {model: start(args, tmp_path / f"{model}.log", cwd=task, env=env) for model, args in runs.items()}
    try:
        for model, proc in procs.items():
            finish(proc, tmp_path / f"{model}.log", f"lm_eval --model {model}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                stop(proc)
    served, reference = samples(tmp_path / "local-completions"), samples(tmp_path / "hf")
    questions = (task / "code_mc.jsonl").read_text().splitlines()
    assert [s["doc_id"] for s in served] == [s["doc_id"] for s in reference] == list(range(len(questions)))
    worst = 0.0
    for got, want in zip(served, reference):
        assert got["arguments"] == want["arguments"]  # the same (context, answer) pairs were scored
        assert len(scores(got)) == len(json.loads(questions[got["doc_id"]])["choices"])
        for (ll, greedy), (ref_ll, ref_greedy) in zip(scores(got), scores(want), strict=True):
            worst = max(worst, abs(ll - ref_ll))
            assert ll == pytest.approx(ref_ll, abs=1e-4), (got["doc_id"], ll, ref_ll)
            assert greedy == ref_greedy, got["doc_id"]
        picked = [max(range(len(s)), key=lambda i: s[i][0]) for s in (scores(got), scores(want))]
        assert picked[0] == picked[1] and got["acc"] == want["acc"], (got["doc_id"], picked)
    assert worst <= 1e-4


# ------------------------------------------------------------------------------------------------------ guidellm
def finished_requests(url: str) -> dict[str, float]:
    "The server's counts of finished requests and of their prompt and generated tokens (/metrics)."
    text = httpx.get(f"{url}/metrics", timeout=60).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {
        "requests": values["vllm:request_prompt_tokens_count"],
        "prompt": values["vllm:request_prompt_tokens_sum"],
        "generation": values["vllm:request_generation_tokens_sum"],
        "generation_requests": values["vllm:request_generation_tokens_count"],
    }


def prompt_tokens(http: httpx.Client, request_args: str) -> int:
    "What the server counts as the prompt of a request guidellm sent (its body, as guidellm logged it)."
    body = json.loads(request_args)["body"]
    query = {"prompt": body["prompt"]} if "prompt" in body else {"messages": body["messages"]}
    response = http.post("/tokenize", json={"model": MODEL} | query)
    assert response.status_code == 200, response.text
    return response.json()["count"]


@pytest.mark.timeout(CLIENT_DEADLINE + 60)
@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_completes_with_the_servers_token_counts(server, tmp_path, request_format):
    report = tmp_path / "guidellm.json"
    args = [sys.executable, "-m", "guidellm", "run"]
    args += ["--backend", f"kind=openai_http,target={server.url},model={MODEL},request_format={request_format}"]
    args += ["--profile", "kind=constant,rate=2", "--constraint", f"kind=max_duration,seconds={GUIDELLM_SECONDS}"]
    args += ["--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"]
    args += ["--tokenizer", f"kind=huggingface_auto,model={TINY_MODEL_PATH}"]
    args += ["--output", f"kind=json,path={report}", "--disable-console-interactive"]
    before = finished_requests(server.url)
    log = tmp_path / "guidellm.log"
    finish(start(args, log, cwd=tmp_path, env=client_env(tmp_path)), log, f"guidellm run ({request_format})")
    after = finished_requests(server.url)
    (bench,) = json.loads(report.read_text())["benchmarks"]
    requests = bench["requests"]
    assert requests["errored"] == [] and bench["scheduler_state"]["errored_requests"] == 0, requests["errored"][:1]
    done = requests["successful"]
    assert done, f"guidellm completed no request:\n{tail(log)}"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for r in done:  # each request: the counts guidellm reports are the server's usage
            assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, r["request_id"]
            assert r["input_metrics"]["text_tokens"] == prompt_tokens(http, r["request_args"]), r["request_id"]
        left = [prompt_tokens(http, r["request_args"]) for r in requests["incomplete"]]
    prompt_sum = sum(r["input_metrics"]["text_tokens"] for r in done)
    metrics = bench["metrics"]  # guidellm's own totals agree with its requests
    assert metrics["prompt_token_count"]["successful"]["total_sum"] == prompt_sum
    assert metrics["output_token_count"]["successful"]["total_sum"] == OUTPUT_TOKENS * len(done)
    server_side = {k: after[k] - before[k] for k in after}
    # The server finished guidellm's completed requests, and perhaps a request that guidellm cancelled at the end of
    # its run just after the server had sent its last token (guidellm lists it as incomplete).
    extra = int(server_side["requests"]) - len(done)
    assert 0 <= extra <= len(left), (server_side, len(done), len(left))
    assert server_side["generation_requests"] == server_side["requests"]
    assert server_side["generation"] == OUTPUT_TOKENS * server_side["requests"]
    assert server_side["prompt"] - prompt_sum in {sum(c) for c in itertools.combinations(left, extra)}, server_side
