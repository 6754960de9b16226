"""The server as clients nobody here wrote use it (notebook 11; project issue 49), on the embedded tiny Qwen3 (float32,
CPU):
- lm-evaluation-harness 0.4.13's `local-completions` scores a multiple-choice question with one request per answer:
  the question and the answer as token ids, `echo: true`, `max_tokens: 1`, `logprobs: 1`, and sums the
  `token_logprobs` of the answer's tokens. The request bodies and the parsing here are lm-eval's own (its
  `LocalCompletionsAPI._create_payload` and `parse_logprobs`); the reference is its `hf` backend's arithmetic
  (log-softmax of transformers' logits, float32): per-sample loglikelihoods within 1e-4, the same greedy flags and
  the same chosen answers. (tests/test_real_clients.py runs lm-eval itself, both backends, on these questions and one
  more, tests/data/code_mc.jsonl, and guidellm too; the replays here are quick and name the field that breaks.)
- `echo` alone and with logprobs, `max_tokens` 0 or more, streamed or not, and `prompt_logprobs`, in vLLM's shape;
- guidellm 0.8.1's request bodies for both endpoints (streamed, `stream_options.continuous_usage_stats`, chat content as
  a list of text parts) work, with usage on every chunk; fields that change nothing are ignored with a warning in the
  log, fields that would change the output are refused by name, image parts are refused by name, and the offline API
  still refuses unknown keyword arguments;
- /metrics has vLLM's v1 names (the list below, from vLLM's docs/design/metrics.md) with the model_name label, keeps the
  `minivllm:` aliases, and its running/waiting gauges drop to 0 when a client hangs up, with no step after;
- /tokenize, /detokenize, /version, GET /v1/models/{id};
- a max_tokens that cannot fit beside the prompt is a 400 naming both numbers; offline `LLM` still stops at the limit.
"""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from _net import wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_serving import (
    API_KEY,
    MODEL,
    assert_error,
    engine_idle,
    serving,  # noqa: F401
    sse_events,
    wait_idle,
)
from test_serving import one_torch_thread as one_torch_thread  # the same autouse fixture here (a re-export)

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.entrypoints.async_llm import AsyncLLM

# A local multiple-choice task (lm-eval's `multiple_choice` output type): context, choices, the gold answer.
QUESTIONS = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " None", " add(a, b)"], 0),
    ("import os\nimport", [" sys", " the", " 42"], 0),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " {}", " 0", " self"], 0),
    ("for i in range(10):\n   ", [" print(i)", " pass", " return"], 0),
]
# vLLM's v1 metric names (docs/design/metrics.md, "v1 Metrics", and the Grafana list's num_requests_waiting), as the
# Prometheus parser names the families (counters without their _total).
VLLM_V1_NAMES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:num_preemptions",
}
OLD_NAMES = {
    "minivllm:num_requests_running",
    "minivllm:num_requests_waiting",
    "minivllm:kv_cache_usage_perc",
    "minivllm:prompt_tokens",
    "minivllm:generation_tokens",
    "minivllm:time_to_first_token_seconds",
    "minivllm:inter_token_latency_seconds",
    "minivllm:e2e_request_latency_seconds",
}


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM(TINY_MODEL_PATH, device="cpu", dtype="float32")
    try:
        with serving(llm, api_key=API_KEY) as served:
            yield served
    finally:
        llm.shutdown()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        yield http
    wait_idle(server.llm)


def complete(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL} | body)
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------------------------------- lm-eval's requests
def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    "lm-eval's TemplateLM._encode_pair (both backends tokenize this way): trailing spaces move to the continuation."
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_enc = tokenizer.encode(context, add_special_tokens=False)
    return context_enc, whole[len(context_enc) :]


def hf_loglikelihood(model, context_enc: list[int], continuation_enc: list[int]) -> tuple[float, bool]:
    "lm-eval's hf backend: log-softmax of the logits over (context + continuation)[:-1], at the continuation's tokens."
    tokens = torch.tensor([context_enc + continuation_enc])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(tokens[:, :-1]).logits.float(), dim=-1)[0, len(context_enc) - 1 :]
    target = torch.tensor(continuation_enc)
    return float(logprobs.gather(1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


def lm_eval_payload(prompts: list[list[int]]) -> dict:
    "LocalCompletionsAPI._create_payload(generate=False), lm-eval 0.4.13."
    return {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def lm_eval_parse(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    "LocalCompletionsAPI.parse_logprobs, lm-eval 0.4.13."
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((sum(tokens_logprobs), is_greedy))
    return res


@pytest.mark.timeout(300)
def test_lm_eval_multiple_choice_matches_its_hf_backend(http, server):
    from transformers import AutoModelForCausalLM

    tokenizer = server.llm.tokenizer
    pairs = [encode_pair(tokenizer, context, choice) for context, choices, _ in QUESTIONS for choice in choices]
    out = complete(http, **lm_eval_payload([c + k for c, k in pairs]))  # (one batch, as lm-eval sends them)
    served = lm_eval_parse(out, [len(c) for c, _ in pairs])
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32).eval()
    reference = [hf_loglikelihood(model, c, k) for c, k in pairs]
    for (got, got_greedy), (want, want_greedy) in zip(served, reference, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
        assert got_greedy == want_greedy
    picks = iter(zip(served, reference))
    for _, choices, _ in QUESTIONS:  # the answer each backend picks (lm-eval's acc): the most likely choice
        rows = [next(picks) for _ in choices]
        assert max(range(len(rows)), key=lambda i: rows[i][0][0]) == max(range(len(rows)), key=lambda i: rows[i][1][0])


@pytest.mark.timeout(120)
def test_echo_with_max_tokens_0_scores_the_prompt_alone(http, server):
    prompt = "def fibonacci(n):"
    ids = server.llm.tokenizer.encode(prompt)
    choice = complete(http, prompt=prompt, echo=True, max_tokens=0, logprobs=2, temperature=0)["choices"][0]
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(top) <= 3 and lp["tokens"][i + 1] in top for i, top in enumerate(lp["top_logprobs"][1:]))
    assert "".join(lp["tokens"]) == prompt
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    prompt_lps = choice["prompt_logprobs"]  # vLLM's extra field: the same numbers by token id
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    assert [entry[str(t)]["logprob"] for entry, t in zip(prompt_lps[1:], ids[1:])] == lp["token_logprobs"][1:]


@pytest.mark.timeout(120)
def test_echo_puts_the_prompt_before_the_completion(http):
    prompt = "import os\nimport"
    plain = complete(http, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)["choices"][0]
    echoed = complete(http, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)["choices"][0]
    assert echoed["text"] == prompt + plain["text"]
    n = len(echoed["logprobs"]["tokens"]) - len(plain["logprobs"]["tokens"])
    assert echoed["logprobs"]["tokens"][n:] == plain["logprobs"]["tokens"]
    assert echoed["logprobs"]["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    assert echoed["logprobs"]["text_offset"][n] == len(prompt)
    alone = complete(http, prompt=prompt, max_tokens=4, temperature=0, echo=True)["choices"][0]
    assert alone["text"] == echoed["text"] and alone["logprobs"] is None and alone["prompt_logprobs"] is None
    extra = complete(http, prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=0)["choices"][0]
    assert extra["prompt_logprobs"][0] is None and len(extra["prompt_logprobs"]) == n
    assert extra["logprobs"] is None and not extra["text"].startswith(prompt)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "body,field",
    [
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # not streamed yet: refused, not ignored
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_echo_misuse_is_400(http, server, body, field):
    assert (
        field in assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x"} | body), 400)["message"]
    )
    assert engine_idle(server.llm)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_joins_to_the_plain_echo(http, max_tokens):
    body = {
        "model": MODEL,
        "prompt": ["def fibonacci(n):", "import os\nimport"],
        "echo": True,
        "logprobs": 1,
        "max_tokens": max_tokens,
        "temperature": 0,
        "n": 2,
    }
    plain = complete(http, **body)["choices"]
    response = http.post("/v1/completions", json=body | {"stream": True})
    assert response.status_code == 200, response.text
    events = sse_events(response.text.splitlines())
    assert events[-1] == "[DONE]"
    joined = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        into = joined.setdefault(choice["index"], {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []})
        into["text"] += choice["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            into[key] += choice["logprobs"][key]
    assert sorted(joined) == [c["index"] for c in plain] == [0, 1, 2, 3]
    for c in plain:
        got = joined[c["index"]]
        assert got["text"] == c["text"] and got["text"].startswith(body["prompt"][c["index"] // 2])
        assert got["tokens"] == c["logprobs"]["tokens"] and got["text_offset"] == c["logprobs"]["text_offset"]
        want = c["logprobs"]["token_logprobs"]  # (batched differently: equal to float32 rounding)
        assert got["token_logprobs"][0] is None is want[0]
        assert got["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-4)


# ------------------------------------------------------------------------------------------ guidellm, fields
def usage_chunks(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = sse_events(response.text.splitlines())
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.timeout(120)
def test_guidellm_request_bodies_stream_with_usage_on_every_chunk(http):
    "guidellm 0.8.1's bodies (backends/openai/request_handlers.py, format()) for both endpoints, 8 output tokens."
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    limit = {"stop": None, "ignore_eos": True}
    for route, body, text_of in [
        ("/v1/completions", {"max_tokens": 8, "prompt": "def fibonacci(n):"}, lambda c: c["text"]),
        (
            "/v1/chat/completions",
            {
                "max_completion_tokens": 8,
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Write a function that reverses a list."}]}
                ],
            },
            lambda c: c["delta"]["content"],
        ),
    ]:
        events = usage_chunks(http.post(route, json={"model": MODEL} | stream | limit | body))
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
        counts = [c["usage"]["completion_tokens"] for c in chunks]  # every chunk: its usage so far
        assert counts == sorted(counts) and counts[-1] == 8
        assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)
        assert "".join(text_of(c["choices"][0]) for c in chunks)
    events = usage_chunks(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
    )
    assert all("usage" not in e for e in events)  # (none asked: none sent)


@pytest.mark.timeout(120)
def test_chat_content_as_text_parts_is_the_joined_text(http):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    parts = [{"type": "text", "text": "Write a function"}, {"type": "text", "text": "that reverses a list."}]
    as_parts = http.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": parts}]})
    as_text = http.post(
        "/v1/chat/completions",
        json=body | {"messages": [{"role": "user", "content": "Write a function\nthat reverses a list."}]},
    )
    assert as_parts.status_code == as_text.status_code == 200, as_parts.text
    assert as_parts.json()["choices"][0]["message"] == as_text.json()["choices"][0]["message"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    response = http.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": [image]}]})
    assert "image_url" in assert_error(response, 400)["message"]


@pytest.mark.timeout(120)
def test_fields_that_change_nothing_are_ignored_with_a_warning(http, caplog):
    extra = {
        "store": False,
        "metadata": {"run": "1"},
        "user": "u",
        "service_tier": "auto",
        "no_such_field": 1,
        "response_format": {"type": "text"},
        "stream_options": None,
    }
    with caplog.at_level(logging.WARNING, logger="minivllm.serve"):
        out = complete(http, prompt="x", max_tokens=2, temperature=0, **extra)
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi", "x": 1}],
            },
        )
    assert out["choices"][0]["finish_reason"] == "length" and chat.status_code == 200, chat.text
    warned = " ".join(r.getMessage() for r in caplog.records if r.name == "minivllm.serve")
    for name in ("store", "metadata", "service_tier", "no_such_field", "messages.0.x"):
        assert name in warned


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "route,extra,field",
    [
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # (no tools to call)
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/completions", {"guided_json": {"type": "nonsense"}}, "json cannot be compiled"),
        ("/v1/completions", {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "exactly one of"),
        ("/v1/completions", {"suffix": "}"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
    ],
)
def test_fields_that_would_change_the_output_are_refused_by_name(http, server, route, extra, field):
    base = (
        {"model": MODEL, "prompt": "x"}
        if route == "/v1/completions"
        else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert field in assert_error(http.post(route, json=base | extra), 400)["message"]
    assert engine_idle(server.llm)


def test_offline_api_still_refuses_unknown_keyword_arguments():
    with pytest.raises(TypeError):
        SamplingParams(store=True)
    with pytest.raises(TypeError):
        SamplingParams(response_format={"type": "json_object"})


# --------------------------------------------------------------------------------------------------- metrics
def families(url: str) -> dict:
    response = httpx.get(f"{url}/metrics", timeout=60)
    assert response.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def gauge(url: str, name: str) -> float:
    return next((s.value for s in families(url)[name].samples if s.labels.get("model_name", MODEL) == MODEL), None)


@pytest.mark.timeout(120)
def test_metrics_have_vllm_v1_names_with_the_model_label(http, server):
    complete(http, prompt="def metrics_probe(x):", max_tokens=4, temperature=0, ignore_eos=True)
    found = families(server.url)
    assert VLLM_V1_NAMES <= found.keys(), sorted(VLLM_V1_NAMES - found.keys())
    assert OLD_NAMES <= found.keys(), sorted(OLD_NAMES - found.keys())  # the aliases, for one release
    for name in VLLM_V1_NAMES:
        samples = found[name].samples
        assert samples and all(s.labels.get("model_name") == MODEL for s in samples), name
    reasons = {s.labels["finished_reason"] for s in found["vllm:request_success"].samples if s.name.endswith("_total")}
    assert "length" in reasons
    values = {s.name: s.value for s in found["vllm:generation_tokens"].samples}
    old = {s.name: s.value for s in found["minivllm:generation_tokens"].samples}
    assert values["vllm:generation_tokens_total"] == old["minivllm:generation_tokens_total"] >= 4


@pytest.mark.timeout(180)
def test_running_gauge_drops_to_0_when_the_client_hangs_up(server):
    "A streaming client reads two chunks and hangs up; no other request runs after: the gauges must drop anyway."
    body = {"model": MODEL, "prompt": "def hang_up(x):", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(4):  # (two chunks and their blank lines)
                next(lines)
            wait_for(lambda: gauge(server.url, "vllm:num_requests_running") == 1, 60, "the request to run")
    wait_for(lambda: engine_idle(server.llm), 60, "the abort")
    wait_for(lambda: gauge(server.url, "vllm:num_requests_running") == 0, 60, "the running gauge to drop")
    assert gauge(server.url, "vllm:num_requests_waiting") == 0
    assert gauge(server.url, "minivllm:num_requests_running") == 0  # (the alias, unlabelled)


# ------------------------------------------------------------------------------------------ vLLM's other routes
@pytest.mark.timeout(60)
def test_tokenize_detokenize_version_and_model_by_id(http, server):
    tokenizer = server.llm.tokenizer
    prompt = "def fibonacci(n):"
    out = http.post("/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    assert out["tokens"] == tokenizer.encode(prompt) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == server.llm.engine.config.max_model_len
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": prompt}
    assert_error(http.post("/tokenize", json={"prompt": "x", "messages": messages}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert_error(http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404)
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card == http.get("/v1/models").json()["data"][0] | {"created": card["created"]}
    assert "gpt-9" in assert_error(http.get("/v1/models/gpt-9"), 404)["message"]
    assert_error(httpx.get(f"{server.url}/v1/models/{MODEL}"), 401)  # (a /v1 route: the key is needed)


# ---------------------------------------------------------------------------------------- max_tokens vs context
@pytest.mark.timeout(60)
def test_max_tokens_beyond_the_context_is_400_naming_both_numbers(http, server):
    limit = server.llm.engine.config.max_model_len
    prompt = list(range(10, 20))  # (token ids: 10 tokens, no tokenizer guesswork)
    error = assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": limit}), 400
    )
    assert f"{limit} > {limit} - 10" in error["message"] and "max_tokens" in error["message"]
    messages = [{"role": "user", "content": "hi"}]
    error = assert_error(
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_completion_tokens": limit}),
        400,
    )
    assert f"{limit} >" in error["message"]
    assert engine_idle(server.llm)  # checked before anything was queued
    out = complete(http, prompt=prompt, max_tokens=2, temperature=0)  # what fits runs
    assert out["usage"]["completion_tokens"] == 2


def test_offline_llm_still_stops_at_max_model_len():
    with LLM(TINY_MODEL_PATH, device="cpu", max_model_len=32) as llm:
        out = llm.generate([list(range(10, 38))], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"
