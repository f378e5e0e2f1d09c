"""The server's error type and the OpenAI error object it becomes.

Every error is `{"error": {"message", "type", "param", "code"}}`; `compat` renders the same
`APIError` as an Anthropic error on /v1/messages."""

from __future__ import annotations

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def openai_error(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)
