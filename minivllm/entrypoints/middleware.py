from __future__ import annotations

import secrets

from starlette.exceptions import HTTPException

from .errors import ERROR_KINDS, error_response


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
