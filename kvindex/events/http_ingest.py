"""Decode ``POST /admin/kv-events`` bodies: the ZMQ payload schema, as msgpack or JSON.

The body is one batch (``[ts, [events...], dp_rank]`` or ``{"ts", "events",
"data_parallel_rank"}``) or a list of such batches. In JSON, bytes hashes are written
as hex strings. The gateway applies the result through the pod's ``PodIngestor``
(``subscriber.ingestor`` when the pod also streams over ZMQ, so both share one map).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvindex.events.types import EngineBatch
from kvindex.events.vllm_adapter import MalformedPayload, batch_from_obj

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
MAX_BATCHES_PER_BODY = 10_000


class BadEventsBody(ValueError):
    """The body is not a batch or list of batches (answer 400)."""


def decode_http_events(body: bytes, content_type: str) -> list[EngineBatch]:
    """Batches in ``body``; raises ``BadEventsBody`` when nothing in it is a batch.

    Malformed events inside a batch are counted in ``EngineBatch.malformed`` and skipped.
    """
    obj = _parse(body, content_type)
    if _is_batch_list(obj):
        if len(obj) > MAX_BATCHES_PER_BODY:
            raise BadEventsBody(f"more than {MAX_BATCHES_PER_BODY} batches in one body")
        raws = obj
    else:
        raws = [obj]
    batches: list[EngineBatch] = []
    for raw in raws:
        try:
            batches.append(batch_from_obj(raw))
        except MalformedPayload as exc:
            raise BadEventsBody(str(exc)) from None
    return batches


def _parse(body: bytes, content_type: str) -> Any:
    media = content_type.split(";", 1)[0].strip().lower()
    try:
        if media in MSGPACK_TYPES:
            return msgspec.msgpack.decode(body)
        if media in ("application/json", "") or media.endswith("+json"):
            return json.loads(body)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise BadEventsBody(f"body does not parse as {media or 'json'}: {exc}") from None
    raise BadEventsBody(f"unsupported content type {media!r} (use msgpack or JSON)")


def _is_batch_list(obj: Any) -> bool:
    """A list of batches starts with a batch (list or map); a batch starts with its ts."""
    return isinstance(obj, list) and bool(obj) and isinstance(obj[0], list | dict)
