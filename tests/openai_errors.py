"""The OpenAI error shape, as every test that checks a gateway error asserts it."""

from __future__ import annotations

import httpx


def assert_openai_error(r: httpx.Response, status: int, *, param: str | None = None) -> dict:
    """``r`` is ``status`` with ``{"error": {"message", "type", "param", "code"}}``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param
    return err
