"""The OpenAI error shape every error the gateway answers itself must have."""

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
