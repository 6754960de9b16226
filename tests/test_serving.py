"""The OpenAI-compatible server and its asyncio engine (notebook 11; project issue 15): AsyncLLM, build_app, the
metrics, `minivllm serve`.

The contract tested here, on the embedded tiny Qwen3 on a CPU:
- through the official `openai` client, completions and chat completions (plain, streamed, n=2, logprobs) give the
  same greedy text as `LLM.generate` / `LLM.chat` for the same prompts; a stream joins to that text, ends with
  `[DONE]`, and its usage chunk counts the tokens;
- 64 concurrent streaming clients, a third of which hang up after a couple of chunks, each get exactly the offline
  reference's text; the requests of those who hung up are aborted (and so is a plain request whose client gives up),
  and afterwards the engine holds no request and every KV block is free;
- a malformed request gets OpenAI's JSON error with the documented status (400, 401, 404, 413, 503 with Retry-After);
- /metrics is Prometheus text with vLLM's metric names, and its latency histograms count each request;
- AsyncLLM's output kinds (CUMULATIVE, DELTA, FINAL_ONLY); cancelling the task that awaits a request aborts it; a bad
  request raises at `generate(...)`; an engine step that fails ends every waiting request with EngineDeadError;
- `python -m minivllm serve` stops on SIGTERM, even with a stream open, and leaves no process behind.
One server (AsyncLLM + uvicorn in a thread) serves the whole module; the offline references are computed once.
Everything that could hang has a time cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch
import uvicorn
from _net import bound_socket, kill_group, start_server, wait_for
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.entrypoints.api_server import build_app
from minivllm.entrypoints.async_llm import AsyncLLM, EngineDeadError
from minivllm.sampling_params import RequestOutputKind

API_KEY = "test-key"
MODEL = "tiny"
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]
NO_THINKING = {"enable_thinking": False}
STREAM_PROMPTS = [f"def helper_{i}(items, key={i}):\n    " for i in range(64)]  # distinct prompts, one per client
STREAM_TOKENS = 24
STREAM_GREEDY = SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)


# ---------------------------------------------------------------------------------------------------------- helpers


def engine_idle(llm: AsyncLLM) -> bool:
    "No request in the engine or awaited, every KV block free (aborts are applied by the engine thread: poll this)."
    bm = llm.engine.scheduler.block_manager
    return (
        not llm.engine.requests
        and not llm.streams
        and not llm.engine.has_unfinished_requests()
        and bm.num_free_blocks == bm.num_blocks
    )


def wait_idle(llm: AsyncLLM, timeout: float = 30.0) -> None:
    try:
        wait_for(lambda: engine_idle(llm), timeout, "the engine to drop every request and free every KV block")
    except AssertionError as e:  # (what is left, as it is now)
        bm = llm.engine.scheduler.block_manager
        left = (
            f"requests {sorted(llm.engine.requests.copy())}, streams {sorted(llm.streams.copy())}, "
            f"free blocks {bm.num_free_blocks}/{bm.num_blocks}"
        )
        raise AssertionError(f"{e}: {left}") from None


@dataclass
class Served:
    url: str
    llm: AsyncLLM
    app: object


@contextlib.contextmanager
def serving(llm: AsyncLLM, **app_kwargs):
    "build_app(llm, ...) served by uvicorn in a thread on a free port for the `with` block."
    app = build_app(llm, MODEL, **app_kwargs)
    sock = bound_socket()  # (bound here: no other process can take the port before uvicorn listens on it)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 30, "uvicorn to start")
        assert server.started, "uvicorn stopped before it started"
        yield Served(f"http://127.0.0.1:{port}", llm, app)
    finally:
        server.should_exit = True
        thread.join(30)
        llm.step_hooks.remove(app.state.metrics.record)  # (this app's metrics no longer follow the shared engine)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop within 30 s"


def assert_error(response: httpx.Response, status: int) -> dict:
    "OpenAI's error shape: {'error': {'message': str, 'type': str, 'code': status}}."
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == status
    return error


def sse_events(lines: list[str]) -> list:
    "The `data:` payloads of a server-sent event stream (JSON decoded, `[DONE]` as is)."
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


# --------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    "The tiny model needs no more, and on a small busy machine the engine, uvicorn and torch's pool would fight."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    "The offline engine's greedy answers for every prompt these tests send (then the engine is closed)."
    with LLM(TINY_MODEL_PATH, device="cpu") as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return {
            "prompts": [o.outputs[0] for o in outs],
            "prompt_ids": [o.prompt_token_ids for o in outs],
            "chat": llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template_kwargs=NO_THINKING)[0].outputs[0],
            "stream": [o.outputs[0].text for o in llm.generate(STREAM_PROMPTS, STREAM_GREEDY, use_tqdm=False)],
        }


@pytest.fixture(scope="module")
def server():
    "One AsyncLLM and its app (model 'tiny', API key 'test-key') served by uvicorn in a thread for the whole module."
    llm = AsyncLLM(TINY_MODEL_PATH, device="cpu")
    try:
        with serving(llm, api_key=API_KEY) as served:
            yield served
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def limited(server):
    "A second app over the same engine: no key, bodies up to 2000 bytes, no room in the queue (every request: 503)."
    with serving(server.llm, max_waiting_requests=0, max_request_bytes=2000) as served:
        yield served


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client
    wait_idle(server.llm)  # every test leaves the engine empty


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        yield http
    wait_idle(server.llm)


# --------------------------------------------------------------------------------------------- the openai client
@pytest.mark.timeout(60)
def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == server.llm.engine.config.max_model_len


@pytest.mark.timeout(60)
def test_completion_matches_offline_greedy(client, reference):
    ref = reference["prompts"][0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].index == 0 and out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.prompt_tokens == len(reference["prompt_ids"][0])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


@pytest.mark.timeout(60)
def test_list_of_prompts_matches_offline_greedy_in_order(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in out.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in out.choices] == [r.text for r in reference["prompts"]]
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in reference["prompts"])
    assert out.usage.prompt_tokens == sum(map(len, reference["prompt_ids"]))


@pytest.mark.timeout(60)
def test_chat_matches_offline_chat(client, reference):
    ref = reference["chat"]
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"chat_template_kwargs": NO_THINKING}
    )
    assert out.object == "chat.completion" and len(out.choices) == 1
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.timeout(60)
def test_streamed_completion_joins_to_the_greedy_text(client, reference):
    ref = reference["prompts"][1]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert len(content) >= 2 and all(len(c.choices) == 1 and c.choices[0].index == 0 for c in content)
    assert "".join(c.choices[0].text for c in content) == ref.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + [ref.finish_reason]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(reference["prompt_ids"][1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.timeout(60)
def test_streamed_chat_joins_to_the_greedy_text(client, reference):
    ref = reference["chat"]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
    )
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == ref.text
    assert content[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.timeout(60)
def test_stream_without_usage_ends_with_the_last_token(client, reference):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == reference["prompts"][2].text


@pytest.mark.timeout(60)
def test_n2_gives_two_choices_reproducible_with_a_seed(client):
    def sample():
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=1234)
        assert sorted(c.index for c in out.choices) == [0, 1]
        assert all(c.finish_reason for c in out.choices)
        return {c.index: c.text for c in out.choices}

    first = sample()
    assert sample() == first
    chat = [
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=99,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        for _ in range(2)
    ]
    assert [sorted(c.index for c in out.choices) for out in chat] == [[0, 1], [0, 1]]
    assert {c.index: c.message.content for c in chat[0].choices} == {
        c.index: c.message.content for c in chat[1].choices
    }


@pytest.mark.timeout(60)
def test_n2_streamed_gives_every_token_of_both_choices(client):
    "Both samples usually finish in the same step: the stream must still carry each one's last token."
    args = dict(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=1234, extra_body={"ignore_eos": True}
    )
    whole = {c.index: c.text for c in client.completions.create(**args).choices}
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert streamed == whole
    assert chunks[-1].usage.completion_tokens == 16
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]


@pytest.mark.timeout(60)
def test_completion_logprobs(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == reference["prompts"][0].text  # asking for logprobs changes no token
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(reference["prompts"][0].token_ids)
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the most likely one
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]


@pytest.mark.timeout(60)
def test_chat_logprobs(client, reference):
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    choice = out.choices[0]
    content = choice.logprobs.content
    assert choice.message.content == reference["chat"].text
    assert len(content) == len(reference["chat"].token_ids)
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert 1 <= len(t.top_logprobs) <= 2 and all(x.logprob <= 0 for x in t.top_logprobs)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # greedy: rank 1
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)


# ------------------------------------------------------------------------------------------------------ concurrency
async def stream_one(http: httpx.AsyncClient, i: int, hang_up: bool) -> list:
    "Client i's stream: its events, or (hanging up after its first 2 chunks) the ones it read before closing."
    body = {
        "model": MODEL,
        "prompt": STREAM_PROMPTS[i],
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "max_tokens": 1000 if hang_up else STREAM_TOKENS,
    }  # (a client that hangs up would be served long)
    lines = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            lines.append(line)
            if hang_up and len(sse_events(lines)) == 2:
                break  # leaving the block closes the connection half-way through the stream
    return sse_events(lines)


@pytest.mark.timeout(120)
def test_64_concurrent_streams_with_disconnects(server, reference):
    hang_ups = {i for i in range(64) if i % 3 == 0}

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, limits=limits
        ) as http:
            return await asyncio.gather(*(stream_one(http, i, i in hang_ups) for i in range(64)))

    generated = server.llm.engine.stats.num_generated_tokens
    results = asyncio.run(main())
    for i, events in enumerate(results):
        if i in hang_ups:
            assert len(events) == 2 and "[DONE]" not in events
            continue
        assert events[-1] == "[DONE]" and all(isinstance(e, dict) and "error" not in e for e in events[:-1])
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == reference["stream"][i], f"client {i}"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    wait_idle(server.llm)
    generated = server.llm.engine.stats.num_generated_tokens - generated
    served = (64 - len(hang_ups)) * STREAM_TOKENS
    assert served < generated < served + len(hang_ups) * 1000 // 4  # the hung-up requests were aborted early


@pytest.mark.timeout(60)
def test_client_that_gives_up_on_a_plain_request_aborts_it(server):
    "A non-streaming request whose client times out is aborted (the server looks twice a second), not run out."
    generated = server.llm.engine.stats.num_generated_tokens
    body = {"model": MODEL, "prompt": "def forever():\n", "max_tokens": 1500, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    wait_idle(server.llm)
    assert server.llm.engine.stats.num_generated_tokens - generated < 1500


# ----------------------------------------------------------------------------------------------------------- errors
@pytest.mark.timeout(60)
def test_invalid_json_is_400(http):
    response = http.post(
        "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"Content-Type": "application/json"}
    )
    assert "JSON" in assert_error(response, 400)["message"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "route,extra,field",
    [
        ("/v1/completions", {"functions": [{"name": "f"}]}, "functions"),  # (refused by name: OpenAI's old calls)
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),  # a tool without a function
        ("/v1/completions", {"max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"temperature": -1}, "temperature"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "logprobs"),  # top_logprobs without logprobs=true
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"n": 10**12}, "SamplingParams.n"),  # (queueing a sample at a time would never end)
        ("/v1/completions", {"n": 1025}, "n=1025"),  # more than the server's queue: a retry cannot help
        ("/v1/chat/completions", {"n": 1025}, "n=1025"),
        ("/v1/completions", {"n": 2, "seed": 2**64 - 1, "stream": True}, "seed"),  # a 400, not an error event in a 200
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),  # (0 is not "unset")
        ("/v1/chat/completions", {"max_completion_tokens": 2, "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"logit_bias": {"5": 1e308}}, "logit_bias"),  # OpenAI's range: [-100, 100]
        (
            "/v1/chat/completions",
            {"chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}},
            "chat_template",
        ),  # a request's own template would run on the event loop
    ],
)
def test_invalid_request_is_400_naming_the_field(http, server, route, extra, field):
    base = {"model": MODEL, "prompt": "x"} if route == "/v1/completions" else {"model": MODEL, "messages": MESSAGES}
    response = http.post(route, json=base | extra)
    assert field in assert_error(response, 400)["message"]
    assert engine_idle(server.llm)  # nothing was queued


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800"}'),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}'),
    ],
)
def test_text_with_a_lone_surrogate_is_400(http, server, route, body):
    "Valid JSON (an escaped lone surrogate), but not Unicode text: the tokenizer's own error named neither."
    response = http.post(route, content=body, headers={"content-type": "application/json"})
    assert "not valid Unicode text" in assert_error(response, 400)["message"]
    assert engine_idle(server.llm)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_max_model_len_is_400(http, server, stream):
    too_long = list(range(1, server.llm.engine.config.max_model_len + 2))  # token ids: no tokenizer guesswork
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": too_long, "stream": stream})
    assert "max_model_len" in assert_error(response, 400)["message"]
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": ["x", too_long]})  # one bad prompt
    assert_error(response, 400)
    long_message = [{"role": "user", "content": " ".join(["word"] * server.llm.engine.config.max_model_len)}]
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": long_message, "stream": stream})
    assert "max_model_len" in assert_error(response, 400)["message"]
    wait_idle(server.llm)  # the good prompt queued before the bad one was aborted


@pytest.mark.timeout(60)
def test_unknown_model_and_route_are_404(http):
    response = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert "gpt-4" in assert_error(response, 404)["message"]
    response = http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": MESSAGES})
    assert_error(response, 404)
    assert_error(http.get("/v1/embeddings"), 404)
    assert_error(http.get("/no/such/route"), 404)


@pytest.mark.timeout(60)
def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):  # (a server without the parser)
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"tools": [{"type": "function", "function": {"name": "f"}}]}
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


@pytest.mark.timeout(60)
def test_body_over_the_cap_is_413(limited):
    with httpx.Client(base_url=limited.url, timeout=60) as http:
        big = {"model": MODEL, "prompt": "x" * 5000}
        assert_error(http.post("/v1/completions", json=big), 413)  # Content-Length says so
        data = json.dumps(big).encode()
        chunked = http.post(
            "/v1/completions",
            content=iter([data[i : i + 500] for i in range(0, len(data), 500)]),
            headers={"Content-Type": "application/json"},
        )
        assert chunked.request.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in chunked.request.headers
        assert_error(chunked, 413)  # counted as it arrives
        small = json.dumps({"model": MODEL, "prompt": "x"}).encode()
        chunked = http.post(
            "/v1/completions", content=iter([small[:10], small[10:]]), headers={"Content-Type": "application/json"}
        )
        assert_error(chunked, 503)  # a small chunked body passes the cap (and meets the full queue)


@pytest.mark.timeout(60)
def test_no_room_in_the_queue_is_503_with_retry_after(limited):
    with httpx.Client(base_url=limited.url, timeout=60) as http:
        for route, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "x"}),
            ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}),
        ):
            response = http.post(route, json=body)
            assert_error(response, 503)
            assert int(response.headers["retry-after"]) >= 1
        assert http.get("/health").status_code == 200  # only new work is refused
    assert engine_idle(limited.llm)


@pytest.mark.timeout(60)
def test_api_key_is_enforced(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
            assert_error(http.get("/v1/models", headers=headers), 401)
            assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers), 401)
            assert_error(
                http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, headers=headers), 401
            )
        assert http.get("/health").status_code == 200 and http.get("/health").json() == {"status": "ok"}
        assert http.get("/metrics").status_code == 200
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0, timeout=60)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()


# ---------------------------------------------------------------------------------------------------------- metrics
def scrape(url: str) -> dict[str, float]:
    "Every sample of /metrics (no key needed) by name; a histogram's buckets are left out."
    response = httpx.get(f"{url}/metrics", timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        s.name: s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
        if not s.name.endswith("_bucket")
    }


@pytest.mark.timeout(60)
def test_metrics_are_prometheus_text_and_count_requests(client, server):
    names = (
        "minivllm:num_requests_running",
        "minivllm:num_requests_waiting",
        "minivllm:kv_cache_usage_perc",
        "minivllm:prompt_tokens_total",
        "minivllm:generation_tokens_total",
        "minivllm:time_to_first_token_seconds_count",
        "minivllm:inter_token_latency_seconds_count",
        "minivllm:time_to_first_token_seconds_sum",
        "minivllm:inter_token_latency_seconds_sum",
    )
    before = scrape(server.url)
    assert set(names) <= before.keys(), sorted(set(names) - before.keys())
    out = client.completions.create(
        model=MODEL, prompt="def metrics_probe(x):", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    tokens = out.usage.completion_tokens
    assert tokens == 8

    def grown():  # (the engine thread records a step after handing its outputs on: poll)
        now = scrape(server.url)
        return (
            now
            if (
                now["minivllm:time_to_first_token_seconds_count"] > before["minivllm:time_to_first_token_seconds_count"]
                and now["minivllm:inter_token_latency_seconds_count"]
                >= before["minivllm:inter_token_latency_seconds_count"] + tokens - 1
            )
            else None
        )

    after = wait_for(grown, 30, "the latency histograms to count the request")
    growth = {name: after[name] - before[name] for name in names}
    assert growth["minivllm:time_to_first_token_seconds_count"] == 1
    assert growth["minivllm:inter_token_latency_seconds_count"] == tokens - 1
    assert growth["minivllm:time_to_first_token_seconds_sum"] > 0
    assert growth["minivllm:generation_tokens_total"] == tokens
    assert 0 < growth["minivllm:prompt_tokens_total"] <= out.usage.prompt_tokens
    assert after["minivllm:num_requests_running"] == after["minivllm:num_requests_waiting"] == 0
    assert 0 <= after["minivllm:kv_cache_usage_perc"] <= 1


# -------------------------------------------------------------------------------------------- AsyncLLM, no HTTP
async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str | None = None) -> list:
    return [out async for out in llm.generate(prompt, params, request_id)]


def with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens, output_kind=kind)


@pytest.mark.timeout(60)
def test_async_cumulative_outputs_grow_to_the_final_text(server, reference):
    ref = reference["prompts"][0]
    outs = asyncio.run(collect(server.llm, PROMPTS[0], with_kind(GREEDY, RequestOutputKind.CUMULATIVE)))
    texts = [o.outputs[0].text for o in outs]
    ids = [o.outputs[0].token_ids for o in outs]
    assert len(outs) > 1 and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert all(len(b) > len(a) and b[: len(a)] == a for a, b in zip(ids, ids[1:]))
    assert texts[-1] == ref.text and ids[-1] == ref.token_ids
    assert outs[-1].outputs[0].finish_reason == ref.finish_reason
    wait_idle(server.llm)


@pytest.mark.timeout(60)
def test_async_deltas_join_to_the_final_text(server, reference):
    ref = reference["prompts"][1]
    outs = asyncio.run(collect(server.llm, PROMPTS[1], with_kind(GREEDY, RequestOutputKind.DELTA)))
    assert len(outs) > 1 and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert "".join(o.outputs[0].text for o in outs) == ref.text
    assert [t for o in outs for t in o.outputs[0].token_ids] == ref.token_ids
    wait_idle(server.llm)


@pytest.mark.timeout(60)
def test_async_final_only_gives_one_output(server, reference):
    ref = reference["prompts"][2]
    outs = asyncio.run(collect(server.llm, PROMPTS[2], with_kind(GREEDY, RequestOutputKind.FINAL_ONLY)))
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == ref.text and outs[0].outputs[0].token_ids == ref.token_ids
    wait_idle(server.llm)


@pytest.mark.timeout(60)
def test_cancelling_the_awaiting_task_aborts_the_request(server):
    llm = server.llm
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate("def forever():\n", params, "cancel-me"):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        assert "cancel-me" in llm.engine.requests
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(llm)  # aborted, not run out to 1500 tokens
    assert llm.is_running


@pytest.mark.timeout(60)
def test_leaving_a_loop_with_break_aborts_the_request(server):
    "The stream, held by nothing after `break`, is collected and aborts its request (it ran on, its id taken for good)."
    llm = server.llm
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        async for _ in llm.generate("def forever():\n", params, "brk"):
            break
        again = [out async for out in llm.generate("def f():", SamplingParams(max_tokens=2), "brk")]  # free at once
        assert again[-1].finished and again[-1].outputs[0].finish_reason in ("length", "stop")

    asyncio.run(main())
    wait_idle(llm)  # aborted, not run out to 1500 tokens


@pytest.mark.timeout(90)
def test_a_dropped_stream_goes_at_once_while_the_engine_steps(server):
    """Only the event loop's thread holds a stream (the engine thread has weak references): the moment its reader lets
    go, mid-stream, it is collected and its id is free, whatever the engine thread is doing."""
    llm = server.llm
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        for _ in range(20):
            stream = llm.generate("def forever():\n", params, "drop")
            async for _ in stream:  # outputs are flowing: the engine thread is stepping and handing them over
                break
            gone = weakref.ref(stream)
            del stream
            assert gone() is None and "drop" not in llm.streams

    asyncio.run(main())
    wait_idle(llm)  # every one aborted, not run out to 1500 tokens


@pytest.mark.timeout(90)
def test_an_abort_reaches_only_the_request_it_was_meant_for(server):
    """Ids are reused once a request ends: a stale abort, a closed stream's abort, or a sample's id must not end a
    later request of the same id or another request; an abort ends every sample, a late one changes nothing."""
    llm, kinds = server.llm, RequestOutputKind
    short, long = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 500))

    async def last(stream):
        return [out async for out in stream][-1]

    async def main():
        first = await last(llm.generate("def f():", short, "again"))
        await llm.abort("again")  # it has ended: nothing
        second = await last(llm.generate("def f():", short, "again"))
        assert second.outputs[0].finish_reason == "length" and second.outputs[0].token_ids == first.outputs[0].token_ids
        gone = llm.generate("def g():", long, "retry")
        await gone.__anext__()
        await gone.aclose()  # a client that gives up and retries at once
        retry = await last(llm.generate("def g():", short, "retry"))
        assert retry.outputs[0].finish_reason == "length" and len(retry.outputs[0].token_ids) == 8
        two = llm.generate(
            "def h():",
            SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=500, ignore_eos=True, output_kind=kinds.CUMULATIVE),
            "n2",
        )
        await two.__anext__()
        await llm.abort("n2")
        out = await last(two)
        assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "abort"), (1, "abort")]
        assert out.prompt_token_ids == llm.tokenizer.encode("def h():") and all(c.token_ids for c in out.outputs)
        done = llm.generate(
            "def k():",
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=kinds.FINAL_ONLY),
            "done",
        )
        await asyncio.wait_for(done.ready.wait(), 30)  # its final output has arrived, unread
        await llm.abort("done")  # finished, not read yet: its output stands
        assert (await last(done)).outputs[0].finish_reason == "length"
        x = llm.generate(
            "def f():",
            SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=30, ignore_eos=True, output_kind=kinds.DELTA),
            "x",
        )
        await x.__anext__()
        with pytest.raises(ValueError, match="already in use"):  # a sample of x runs as '0_x'
            await last(llm.generate("def g():", short, "0_x"))
        await llm.abort("0_x")  # not a request of this front end: nothing
        ended = {c.index: c.finish_reason for o in [out async for out in x] for c in o.outputs if c.finish_reason}
        assert ended == {0: "length", 1: "length"}

    asyncio.run(main())
    wait_idle(llm)


@pytest.mark.timeout(60)
def test_bad_request_raises_at_generate(server):
    llm = server.llm
    vocab = llm.engine.config.hf_config.vocab_size

    async def main():
        with pytest.raises(ValueError, match="stop_token_ids"):
            llm.generate("x", SamplingParams(stop_token_ids=[vocab]))
        changed = SamplingParams()
        changed.temperature = -1.0  # (made valid, then spoilt: the engine checks again)
        with pytest.raises(ValueError, match="temperature"):
            llm.generate("x", changed)
        with pytest.raises(ValueError):
            llm.generate(list(range(1, llm.engine.config.max_model_len + 2)), SamplingParams())
        with pytest.raises((ValueError, TypeError)):
            llm.generate(12345, SamplingParams())
        assert not llm.streams
        stream = llm.generate("x", SamplingParams(max_tokens=50, ignore_eos=True), "taken")
        with pytest.raises(ValueError, match="already in use"):
            llm.generate("y", SamplingParams(), "taken")
        await stream.aclose()

    asyncio.run(main())
    wait_idle(llm)


@pytest.mark.timeout(90)
def test_engine_step_error_reaches_every_request_as_engine_dead(monkeypatch):
    llm = AsyncLLM(TINY_MODEL_PATH, device="cpu")
    gate = threading.Event()

    def broken_step():
        gate.wait(30)  # every request is queued before the step fails
        raise RuntimeError("boom in step")

    monkeypatch.setattr(llm.engine, "step", broken_step)

    async def main():
        transport = httpx.ASGITransport(app=build_app(llm, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            streams = [llm.generate(f"prompt {i}", SamplingParams(max_tokens=8)) for i in range(3)]
            posts = [
                asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", "stream": stream}))
                for stream in (False, True)
            ]
            for _ in range(300):  # the two HTTP requests are in the engine's hands too
                if len(llm.streams) == 5:
                    break
                await asyncio.sleep(0.01)
            assert len(llm.streams) == 5
            gate.set()
            for stream in streams:
                with pytest.raises(EngineDeadError, match="boom in step"):
                    await asyncio.wait_for(collect_stream(stream), 30)
            plain, streamed = await asyncio.wait_for(asyncio.gather(*posts), 30)
            assert "boom in step" in assert_error(plain, 503)["message"]
            events = sse_events(streamed.text.splitlines())  # a stream already under way: an error event
            assert events[-1] == "[DONE]" and "boom in step" in events[-2]["error"]["message"]
            with pytest.raises(EngineDeadError):
                llm.generate("after", SamplingParams(max_tokens=8))
            assert not llm.is_running and isinstance(llm.error, RuntimeError) and not llm.streams
            assert (await http.get("/health")).status_code == 503  # the server says so too
            assert_error(await http.post("/v1/completions", json={"prompt": "x"}), 503)

    try:
        asyncio.run(main())
    finally:
        gate.set()
        llm.shutdown()


async def collect_stream(stream) -> list:
    return [out async for out in stream]


# ------------------------------------------------------------------------------------------------ minivllm serve
@pytest.mark.timeout(180)
def test_serve_stops_on_sigterm_and_leaves_no_process(tmp_path, reference):
    log = tmp_path / "serve.log"
    args = [sys.executable, "-m", "minivllm", "serve", TINY_MODEL_PATH, "--device", "cpu", "--api-key", "cli-key"]
    args += ["--served-model-name", MODEL, "--log-level", "warning"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc, url = start_server(lambda port: [*args, "--port", str(port)], log, 90, env=env)
    headers = {"Authorization": "Bearer cli-key"}

    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
            out = http.post(
                "/v1/completions",
                headers=headers,
                json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0},
            )
            assert out.status_code == 200 and out.json()["choices"][0]["text"] == reference["prompts"][0].text
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            with http.stream(
                "POST",
                "/v1/completions",
                headers=headers,  # a stream still open at SIGTERM
                json={"model": MODEL, "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True},
            ) as stream:
                lines = stream.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                rest = "\n".join(lines)  # the engine stops first: the stream ends with its error
                code = proc.wait(timeout=30)
        # the engine stopped first: the stream got its error event (uvicorn's graceful timeout would have cancelled it
        # with tracebacks in the log), however long a busy machine took to get there
        assert "the engine was shut down" in rest and "[DONE]" in rest, rest[-300:]
        assert "Traceback" not in read(log) and "never retrieved" not in read(log), read(log)
        # uvicorn re-raises the SIGTERM it caught once it has shut down gracefully: 0 or -SIGTERM are both "stopped"
        assert code in (0, -signal.SIGTERM), f"exit status {code}:\n{read(log)}"
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"left behind: {alive}"
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # nothing at all is left in its process group
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        kill_group(proc)


def read(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]
