"""The error shapes every error the gateway answers itself must have: OpenAI's, and
Anthropic's on the Anthropic Messages endpoints."""

from __future__ import annotations

import json

import httpx


def assert_openai_error(r: httpx.Response, status: int, *, param: str | None = None) -> dict:
    """``r`` is ``status`` with body ``{"error": {message, type, param, code}}``; returns it."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = _error_of(r.json())
    if param is not None:
        assert err["param"] == param
    return err


def assert_openai_error_event(event: bytes, status: int) -> dict:
    """``event`` is one SSE event whose data is a ``status`` error in the OpenAI shape."""
    assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
    assert event.count(b"\n\n") == 1, f"more than one event: {event!r}"
    err = _error_of(json.loads(event[len(b"data: ") :]))
    assert err["code"] == status, err
    return err


def _error_of(body: object) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


ANTHROPIC_ERROR_TYPES = {
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
    "request_too_large", "rate_limit_error", "api_error", "overloaded_error", "timeout_error",
}  # fmt: skip


def assert_anthropic_error(r: httpx.Response, status: int) -> dict:
    """``r`` is ``status`` with body ``{"type": "error", "error": {type, message}}``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    return _anthropic_error_of(r.json())


def assert_anthropic_error_event(event: bytes) -> dict:
    """``event`` is one SSE ``error`` event in Anthropic's shape."""
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n"), event
    assert event.count(b"\n\n") == 1, f"more than one event: {event!r}"
    return _anthropic_error_of(json.loads(event[len(b"event: error\ndata: ") :]))


def _anthropic_error_of(body: object) -> dict:
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error"
    err = body["error"]
    assert set(err) == {"type", "message"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ANTHROPIC_ERROR_TYPES, err
    return err
