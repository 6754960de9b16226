from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..llm import as_prompt_list
from ..outputs import RequestOutput
from .async_llm import AsyncLLM, RequestOutputStream
from .errors import ERROR_KINDS, APIError, add_error_handlers
from .metrics import EngineMetrics
from .middleware import APIKeyCheck, BodyLimit
from .openai_format import (chat_chunks, chat_logprobs, completion_choice, completion_chunks, sse, usage)
from .protocol import ChatCompletionRequest, CompletionRequest


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None, max_waiting_requests: int = 1024,
              max_request_bytes: int = 1 << 20) -> FastAPI:
    "The OpenAI-compatible app over `llm`: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics."
    from .. import __version__
    app = FastAPI(title="minivllm", version=__version__)
    app.state.llm, app.state.model_name, app.state.max_waiting = llm, model_name, max_waiting_requests
    app.state.registry = CollectorRegistry()
    app.state.metrics = EngineMetrics(llm, app.state.registry)
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    add_routes(app)
    return app


def add_routes(app: FastAPI) -> None:
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.get("/v1/models")(models)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)


async def health(request: Request):
    ok = request.app.state.llm.is_running
    return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)


async def metrics(request: Request):
    return PlainTextResponse(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request):
    state = request.app.state
    card = {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "minivllm",
            "root": state.llm.engine.config.model, "max_model_len": state.llm.engine.config.max_model_len}
    return {"object": "list", "data": [card]}


def submit(request: Request, model: str | None, prompts: list, params, prefix: str) -> list[RequestOutputStream]:
    "Check the model and the room in the queue, then queue every prompt (a bad one: 400, the others are aborted)."
    state = request.app.state
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist (this server has {state.model_name!r})",
                       ERROR_KINDS[404])
    llm: AsyncLLM = state.llm
    if llm.num_waiting + len(prompts) > state.max_waiting:
        raise APIError(503, f"over {state.max_waiting} requests are waiting: retry later", ERROR_KINDS[503],
                       headers={"Retry-After": "1"})
    request_id, streams = f"{prefix}-{uuid.uuid4().hex}", []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(llm.generate(prompt, params, f"{request_id}-{i}"))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def until_disconnected(request: Request, streams: list[RequestOutputStream]) -> list[RequestOutput]:
    "Every stream's final output; a client that hangs up first aborts them (checked twice a second)."
    async def final(stream):
        async for out in stream:
            pass
        return out
    work = asyncio.ensure_future(asyncio.gather(*map(final, streams)))
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=0.5)
            if not work.done() and await request.is_disconnected():
                work.cancel()
        return work.result()
    finally:
        work.cancel()
        for stream in streams:
            stream.close()


async def completions(body: CompletionRequest, request: Request):
    llm: AsyncLLM = request.app.state.llm
    prompts = as_prompt_list(body.prompt)
    params = body.sampling_params(llm.engine.default_params, body.max_tokens, body.logprobs)
    streams = submit(request, body.model, prompts, params, "cmpl")
    head = {"id": streams[0].request_id.rsplit("-", 1)[0], "created": int(time.time()),
            "model": request.app.state.model_name}
    if body.stream:
        return sse(completion_chunks(streams, head, params.n, body.include_usage))
    finals = await until_disconnected(request, streams)
    choices = [completion_choice(i * params.n + c.index, c) for i, out in enumerate(finals) for c in out.outputs]
    return {**head, "object": "text_completion", "choices": choices, "usage": usage(finals)}


async def chat_completions(body: ChatCompletionRequest, request: Request):
    llm: AsyncLLM = request.app.state.llm
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", ERROR_KINDS[400])
    if llm.tokenizer is None:
        raise APIError(400, "chat needs a tokenizer (the engine was started without one)", ERROR_KINDS[400])
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, **(body.chat_template_kwargs or {}),
                                                   add_generation_prompt=body.add_generation_prompt)
    except Exception as e:   # (jinja's errors: a template that rejects these messages)
        raise APIError(400, f"the chat template failed on these messages: {e}", ERROR_KINDS[400]) from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(llm.engine.default_params, body.max_completion_tokens or body.max_tokens, logprobs)
    streams = submit(request, body.model, [prompt], params, "chatcmpl")
    head = {"id": streams[0].request_id, "created": int(time.time()), "model": request.app.state.model_name}
    if body.stream:
        return sse(chat_chunks(streams, head, logprobs, body.include_usage))
    finals = await until_disconnected(request, streams)
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, logprobs), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason} for c in finals[0].outputs]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage(finals)}
