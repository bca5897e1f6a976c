"""Bodies that parse but are shaped to break what routing does with them get a 4xx (or are
routed), never a 500: JSON nested just shallower than the parser's limit, wrongly typed
fields of the less common APIs, and the admin lookup's own fields."""

from __future__ import annotations

import json

import pytest

from tests.inproc.harness import inproc_gateway
from tests.inproc.scripted_pod import MODEL
from tests.openai_errors import assert_openai_error

# msgspec parses JSON nested up to Python's recursion limit (1,000 frames, some taken
# by the caller); what routing walks recursively afterwards then runs out of frames.
DEPTHS = range(900, 1001)


NESTED = "@nested@"


def _body(shape: dict, depth: int) -> bytes:
    """``shape`` as JSON with ``NESTED`` replaced by a string in ``depth`` arrays (built as
    text: Python's own encoder cannot write what is this deep)."""
    nested = "[" * depth + '"x"' + "]" * depth
    return json.dumps(shape).replace(json.dumps(NESTED), nested).encode()


def _chat(**extra: object) -> dict:
    return {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hello"}], **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "shaped"),
    [
        # prefix-aware hashes a non-text content part by its JSON
        (
            "prefix-aware",
            _chat(
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": NESTED}]}]
            ),
        ),  # fmt: skip
        # the session strategy reads its key from the body's "user"
        ("session", _chat(user=NESTED)),
    ],
)
async def test_json_nested_near_the_parsers_limit_is_never_a_500(pod_a, strategy, shaped):
    async with inproc_gateway(pod_a, strategy=strategy) as g:
        statuses = {}
        for depth in DEPTHS:
            r = await g.client.post("/v1/chat/completions", content=_body(shaped, depth))
            statuses[depth] = r.status_code
            if r.status_code == 400:
                assert "nested" in r.json()["error"]["message"]
        assert set(statuses.values()) <= {200, 400}, statuses
        assert 400 in statuses.values()  # the sweep reaches the parser's limit


@pytest.mark.parametrize("messages", ["hi", [1], {"a": 1}, 5, []])
async def test_tokenize_with_badly_typed_messages_is_400(pod_a, messages):
    async with inproc_gateway(pod_a) as g:
        r = await g.client.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert_openai_error(r, 400, param="messages")
    assert pod_a.received == []


@pytest.mark.parametrize("api", [["chat"], {"kind": "chat"}, 7])
async def test_the_admin_lookup_with_a_non_string_api_is_400(pod_a, api):
    async with inproc_gateway(pod_a, strategy="kv-aware") as g:
        body = {"model": MODEL, "api": api, "prompt": "hello"}
        r = await g.admin.post("/admin/index/lookup", json=body)
        assert_openai_error(r, 400, param="api")
