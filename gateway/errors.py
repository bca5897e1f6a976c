"""Errors the gateway answers itself, in the shape of the API that was called.

OpenAI's (every endpoint but Anthropic's): ``{"error": {"message", "type", "param",
"code"}}``. Anthropic's (``/v1/messages``): ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's error types. Mid-stream failures are one SSE event in
the same shape (Anthropic's as an ``event: error``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from starlette.responses import Response

ErrorStyle = Literal["openai", "anthropic"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
# Anthropic's error types (docs "HTTP errors"; the SDK's ErrorObject union).
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error the gateway answers itself, before or instead of an upstream reply."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}  # sent with the error, e.g. Retry-After with a 429

    def body(self, style: ErrorStyle = "openai") -> dict[str, Any]:
        if style == "anthropic":
            return anthropic_error_body(self.status, self.message)
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def encoded(self, style: ErrorStyle = "openai") -> bytes:
        return json.dumps(self.body(style)).encode()

    def response(
        self, headers: dict[str, str] | None = None, style: ErrorStyle = "openai"
    ) -> Response:
        return Response(
            json.dumps(self.body(style)),
            status_code=self.status,
            media_type="application/json",
            headers=headers if headers is not None else (self.headers or None),
        )


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, object]]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "api_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    default = "api_error" if status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, default),
                                       "message": message}}  # fmt: skip


def sse_error_event(status: int, message: str, style: ErrorStyle = "openai") -> bytes:
    """A mid-stream failure, as one SSE event the API's client raises on."""
    if style == "anthropic":
        data = json.dumps(anthropic_error_body(status, message)).encode()
        return b"event: error\ndata: " + data + b"\n\n"
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"
