from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from ..llm import as_prompt_list
from ..outputs import RequestOutput
from .async_llm import AsyncLLM, EngineDeadError, RequestOutputStream
from .metrics import EngineMetrics
from .protocol import ChatCompletionRequest, CompletionRequest


class APIError(Exception):
    "An error the client gets as OpenAI's JSON: {'error': {'message', 'type', 'param', 'code'}}."

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def error_response(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


ERROR_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
               413: "RequestTooLarge", 503: "ServiceUnavailableError"}


class APIKeyCheck:
    "Every /v1 route answers 401 without `Authorization: Bearer <key>` (compared in constant time)."

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                          ERROR_KINDS[401])
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    "Bodies over `max_bytes` get 413, whether their Content-Length says so or they turn out longer."

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is over {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, message, ERROR_KINDS[413])(scope, receive, send)
        seen = 0

        async def counted():   # a body without Content-Length (chunked) is counted as it arrives
            nonlocal seen
            received = await receive()
            seen += len(received.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, message)   # (FastAPI passes it on to the error handler)
            return received
        await self.app(scope, counted, send)


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


def add_error_handlers(app: FastAPI) -> None:
    "Every error as OpenAI's JSON with its status."
    def handle(status: int):
        return lambda request, e: error_response(status, str(e), ERROR_KINDS[status])
    app.add_exception_handler(APIError, lambda request, e: error_response(e.status, e.message, e.kind, e.headers))
    app.add_exception_handler(RequestValidationError, lambda request, e: error_response(
        400, validation_message(e), ERROR_KINDS[400]))
    app.add_exception_handler(HTTPException, lambda request, e: error_response(
        e.status_code, str(e.detail), ERROR_KINDS.get(e.status_code, "Error"), getattr(e, "headers", None)))
    app.add_exception_handler(ValueError, handle(400))
    app.add_exception_handler(TypeError, handle(400))
    app.add_exception_handler(EngineDeadError, handle(503))


def validation_message(e: RequestValidationError) -> str:
    "pydantic's errors in one line: `field: problem; ...`."
    parts = []
    for err in e.errors():
        if err["type"] == "json_invalid":
            return f"the body is not valid JSON ({err['ctx'].get('error', 'decode error')} at character {err['loc'][-1]})"
        where = ".".join(str(x) for x in err["loc"][1:]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


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


def completion_choice(index: int, c, offset: int = 0) -> dict:
    return {"index": index, "text": c.text, "logprobs": completion_logprobs(c, offset),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def completion_logprobs(c, offset: int = 0) -> dict | None:
    "OpenAI's completions format: tokens, token_logprobs, top_logprobs, text_offset."
    if c.logprobs is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(c.token_ids, c.logprobs):
        chosen = entry[token_id]
        out["tokens"].append(chosen.decoded_token)
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append({lp.decoded_token: lp.logprob for lp in entry.values()})
        out["text_offset"].append(offset)
        offset += len(chosen.decoded_token or "")
    return out


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    "Server-sent events: `data: <json>` per event, an error as an event, `data: [DONE]` at the end."
    async def lines():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except (ValueError, TypeError, EngineDeadError) as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': type(e).__name__}})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(lines(), media_type="text/event-stream")


async def merge_streams(streams: list[RequestOutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    "(index, output) from all the streams as they come; leaving early (a client gone) aborts them all."
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestOutputStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(tasks):
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                ended += 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def completion_chunks(streams, head: dict, n: int, include_usage: bool) -> AsyncIterator[dict]:
    sent, prompts, completion = {}, {}, 0   # characters sent per choice (for text_offset); prompt lengths
    async for i, out in merge_streams(streams):
        prompts[i] = len(out.prompt_token_ids) or prompts.get(i, 0)
        for c in out.outputs:
            index = i * n + c.index
            completion += len(c.token_ids)
            yield {**head, "object": "text_completion", "choices": [completion_choice(index, c, sent.get(index, 0))]}
            sent[index] = sent.get(index, 0) + len(c.text)
    if include_usage:
        yield {**head, "object": "text_completion", "choices": [], "usage": {
            "prompt_tokens": sum(prompts.values()), "completion_tokens": completion,
            "total_tokens": sum(prompts.values()) + completion}}


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


def chat_logprobs(c, top: int | None) -> dict | None:
    "OpenAI's chat format: per token its text, logprob, bytes and the `top` most likely alternatives."
    if c.logprobs is None:
        return None
    def item(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        best = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top), key=lambda lp: lp.rank)
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in best]})
    return {"content": content}


async def chat_chunks(streams, head: dict, top: int | None, include_usage: bool) -> AsyncIterator[dict]:
    started, prompt, completion = set(), 0, 0
    async for _, out in merge_streams(streams):
        prompt = len(out.prompt_token_ids) or prompt
        for c in out.outputs:
            delta = {"content": c.text} if c.index in started else {"role": "assistant", "content": c.text}
            started.add(c.index)
            completion += len(c.token_ids)
            choice = {"index": c.index, "delta": delta, "logprobs": chat_logprobs(c, top),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            yield {**head, "object": "chat.completion.chunk", "choices": [choice]}
    if include_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
