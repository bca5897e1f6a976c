"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from starlette.responses import Response

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


class GatewayError(Exception):
    """An error the gateway answers itself, before or instead of an upstream reply."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, object]]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(
            json.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
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


def sse_error_event(status: int, message: str) -> bytes:
    """A mid-stream failure, as one SSE event the OpenAI client raises on."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"
