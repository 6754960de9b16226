"""Structured outputs and tool calls through `minivllm serve` and the official `openai` client (issue 50): response
formats and vLLM's fields, forced tool calls whose arguments always validate, the Hermes parser for calls the model
makes itself, Qwen3's reasoning split, tool results in the conversation, streamed and not; bad specs are a 400."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_serving import MODEL, assert_error, engine_idle, serving, wait_idle
from test_serving import one_torch_thread as one_torch_thread  # the same autouse fixture here (a re-export)

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.entrypoints.async_llm import AsyncLLM

TEMPLATE = (Path(__file__).parent / "data" / "qwen3_tools_chat_template.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM(TINY_MODEL_PATH, device="cpu", dtype="float32")
    llm.tokenizer.chat_template = TEMPLATE
    try:
        with serving(llm, tool_call_parser="hermes", reasoning_parser="qwen3") as served:
            yield served
    finally:
        llm.shutdown()


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    wait_idle(server.llm)


def test_required_tool_calls_always_validate(client):
    "tool_choice='required' is a grammar: every call names a tool and its arguments validate, sampled 12 times."
    for seed in range(12):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments, strict=False), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments_streamed_or_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=named, temperature=0, max_tokens=100
    )
    call = chat.choices[0].message.tool_calls[0]
    assert chat.choices[0].finish_reason == "stop" and call.function.name == "get_time"  # (OpenAI's finish reason)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice=named,
            temperature=0,
            max_tokens=100,
            stream=True,
        )
    )
    streamed = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [
        (0, "get_time", call.function.arguments)
    ]


def test_calls_the_model_writes_itself_are_parsed(client):
    "tool_choice='auto' with the Hermes parser; the model is steered into writing a call by a regex."
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    steer = {"structured_outputs": {"regex": "I will check\\. " + re.escape(written)}}
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=80, extra_body=steer
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})
    ]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER],
            temperature=0,
            max_tokens=80,
            extra_body=steer,
            stream=True,
        )
    )
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    calls = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert content == "I will check." and [tc.function.name for tc in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_is_split_from_the_answer(client):
    steer = {"structured_outputs": {"regex": "<think>\\nThe user wants a city\\.\\n</think>\\n\\nParis"}}
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, extra_body=steer
    )
    message = chat.choices[0].message
    assert message.content == "Paris" and message.reasoning_content == "The user wants a city."
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, extra_body=steer, stream=True
        )
    )
    deltas = [c.delta for ch in chunks for c in ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants a city."
    assert "".join(d.content or "" for d in deltas) == "Paris"


def test_tool_results_go_back_into_the_conversation(server, client):
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
    }
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "14:05"},
    ]
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60).json()
    text = server.llm.tokenizer.decode(rendered["tokens"])
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' in text
    assert "<tool_response>\n14:05\n</tool_response>" in text
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=[TIME], temperature=0, max_tokens=8)
    assert chat.choices[0].message.content is not None


@pytest.mark.parametrize(
    "route, extra, check",
    [
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": SCHEMAS["get_weather"], "strict": True},
                }
            },
            "schema",
        ),
        ("chat", {"response_format": {"type": "json_object"}}, "object"),
        ("completions", {"guided_choice": ["alpha", "beta"]}, "choice"),
        ("completions", {"guided_regex": "[0-9]{3}"}, "regex"),
        ("completions", {"structured_outputs": {"grammar": 'root ::= "x" [a-c]{2}'}}, "grammar"),
        ("completions", {"guided_json": SCHEMAS["get_time"]}, "time"),
    ],
)
def test_response_formats_and_vllm_fields(client, route, extra, check):
    if route == "chat":
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0.7, seed=1, max_tokens=200, extra_body=extra
        )
        text, reason = chat.choices[0].message.content, chat.choices[0].finish_reason
    else:
        out = client.completions.create(
            model=MODEL, prompt="x = ", temperature=0.7, seed=1, max_tokens=200, extra_body=extra
        )
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    if check == "object":  # (any object: it may not end within max_tokens, but it is one from its first token)
        assert text.lstrip().startswith("{") and (
            reason == "length" or isinstance(json.loads(text, strict=False), dict)
        )
        return
    assert reason == "stop", text
    if check == "schema":
        jsonschema.validate(json.loads(text, strict=False), SCHEMAS["get_weather"])
    elif check == "time":
        jsonschema.validate(json.loads(text, strict=False), SCHEMAS["get_time"])
    else:
        assert re.fullmatch({"choice": "alpha|beta", "regex": "[0-9]{3}", "grammar": "x[a-c]{2}"}[check], text)


def test_a_streamed_constrained_completion_is_the_whole_one(client):
    extra = {"guided_regex": "(yes|no), [a-z]{2,8}"}
    whole = client.completions.create(model=MODEL, prompt="ok? ", temperature=0, max_tokens=20, extra_body=extra)
    pieces = client.completions.create(
        model=MODEL, prompt="ok? ", temperature=0, max_tokens=20, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == whole.choices[0].text


@pytest.mark.parametrize(
    "body, words",
    [
        ({"guided_regex": "[0-9"}, "regex cannot be compiled"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "one way"),
        ({"structured_outputs": {"regex": "a", "nonsense": 1}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": [{"type": "function"}]}, "tools.0"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
    ],
)
def test_bad_specs_are_a_400_and_leave_the_engine_idle(server, body, words):
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    error = assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=base | body, timeout=60), 400)
    assert words in error["message"], error["message"]
    assert engine_idle(server.llm)


def test_auto_tool_choice_needs_the_parser():
    llm = AsyncLLM(TINY_MODEL_PATH, device="cpu", dtype="float32")
    try:
        with serving(llm) as served:
            body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 4}
            error = assert_error(httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60), 400)
            assert "--enable-auto-tool-choice" in error["message"]
            body["tool_choice"] = "none"  # tools shown, nothing parsed: a plain answer
            answer = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60).json()
            assert "tool_calls" not in answer["choices"][0]["message"]
    finally:
        llm.shutdown()


def test_offline_chat_shows_the_tools():
    with LLM(TINY_MODEL_PATH, device="cpu") as llm:
        llm.get_tokenizer().chat_template = TEMPLATE
        prompt = llm.chat_prompts(MESSAGES, tools=[WEATHER])[0]
        assert '"name": "get_weather"' in prompt and "<tools>" in prompt
        out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, tools=[WEATHER])
        assert len(out[0].outputs[0].token_ids) > 0
