"""Errors a simulated pod answers, in vLLM 0.32's ``{"error": {...}}`` shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from bench.sim import protocol as p


class ApiError(Exception):
    """An error answered in vLLM's ``{"error": {...}}`` shape."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> JSONResponse:
        body = p.error_body(self.message, self.err_type, self.status, self.param)
        return JSONResponse(body, status_code=self.status)

    def anthropic_response(self) -> JSONResponse:
        """vLLM's ``/v1/messages`` translation: ``{"type": "error", "error": {type, message}}``
        with vLLM's own error type names."""
        body = {"type": "error", "error": {"type": self.err_type, "message": self.message}}
        return JSONResponse(body, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)
