from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .async_llm import EngineDeadError


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
