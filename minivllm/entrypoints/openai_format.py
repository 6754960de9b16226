from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from ..outputs import CompletionOutput, RequestOutput
from .async_llm import EngineDeadError, RequestOutputStream


def completion_choice(index: int, c: CompletionOutput, offset: int = 0) -> dict:
    return {"index": index, "text": c.text, "logprobs": completion_logprobs(c, offset),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def completion_logprobs(c: CompletionOutput, offset: int = 0) -> dict | None:
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


def chat_logprobs(c: CompletionOutput, top: int | None) -> dict | None:
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


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


async def completion_chunks(streams: list[RequestOutputStream], head: dict, n: int, include_usage: bool) -> AsyncIterator[dict]:
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


async def chat_chunks(streams: list[RequestOutputStream], head: dict, top: int | None, include_usage: bool) -> AsyncIterator[dict]:
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
