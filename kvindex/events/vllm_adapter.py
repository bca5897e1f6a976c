"""vLLM's KV-event payloads → ``EngineBatch`` (both event shapes, both hash shapes).

Payload: msgpack ``[ts, [events...], dp_rank]`` (``EventBatch`` is ``array_like``; a
map ``{"ts", "events", "data_parallel_rank"}`` from a few intermediate releases is
accepted too). Events come as

* tagged maps (vLLM >= 0.24): ``{"type": "BlockStored", "block_hashes": ..., ...}``
* positional arrays with the tag first (vLLM <= 0.23, ``array_like=True, tag=True``):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, ...]``; trailing fields with defaults are
  omitted (``omit_defaults``), so arrays may be short.

The positional field orders below are those of ``vllm/distributed/kv_events.py``
(0.10 … 0.32: fields were only ever appended). Unknown fields and event types are
ignored; malformed events are counted in ``EngineBatch.malformed`` and skipped; a
payload that is not a batch raises ``MalformedPayload`` (callers count it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvindex.events.types import (
    EngineBatch,
    EngineCleared,
    EngineEvent,
    EngineHash,
    EngineRemoved,
    EngineStored,
)
from kvindex.keyer import MASK64
from kvindex.types import Tier

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
STORED_REQUIRED = 4  # block_hashes, parent_block_hash, token_ids, block_size
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
REMOVED_REQUIRED = 1
# vLLM's bytes hashes are 32-byte digests (sha256, or a shorter xxhash); twice that
# leaves room for a longer digest without letting one hash pin megabytes in the map.
MAX_HASH_BYTES = 64

_decoder = msgspec.msgpack.Decoder()


class MalformedPayload(ValueError):
    """The payload is not an event batch at all (not msgpack, wrong shape)."""


class _BadEvent(ValueError):
    pass


def tier_of(medium: str | None, locality: str | None) -> Tier | None:
    """Engine medium (+ locality) → tier; None for media this gateway does not index.

    ``None`` medium is what the GPU block pool of releases before ``medium`` existed
    sent, so it is L0. ``STORAGE``/``LOCAL`` (and unspecified locality) is a disk
    only this pod reads: kept per pod as L1, the tier the stores hold per pod below
    L0. Only ``STORAGE``/``REMOTE`` is shared by the fleet (L2).
    """
    if medium is None:
        return Tier.L0
    if not isinstance(medium, str):
        return None
    m = medium.upper()
    if m == "GPU":
        return Tier.L0
    if m == "CPU":
        return Tier.L1
    if m in ("STORAGE", "DISK"):
        is_remote = isinstance(locality, str) and locality.upper() == "REMOTE"
        return Tier.L2 if is_remote else Tier.L1
    return None


def decode_payload(payload: bytes) -> EngineBatch:
    """Decode one msgpack batch payload (raises ``MalformedPayload``)."""
    try:
        obj = _decoder.decode(payload)
    # RecursionError: arrays nested deeper than the interpreter allows (a few bytes
    # per level); no vLLM batch nests more than a handful of levels.
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedPayload(f"not msgpack: {type(exc).__name__}") from None
    return batch_from_obj(obj)


def batch_from_obj(obj: Any) -> EngineBatch:
    """A decoded (msgpack or JSON) batch object → ``EngineBatch`` (raises ``MalformedPayload``)."""
    if isinstance(obj, list) and len(obj) >= 2:
        ts, raw_events = obj[0], obj[1]
        dp_rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict) and "events" in obj:
        ts, raw_events = obj.get("ts", 0.0), obj["events"]
        dp_rank = obj.get("data_parallel_rank")
    else:
        raise MalformedPayload("batch is neither [ts, events, rank] nor a map")
    if not _is_number(ts) or not isinstance(raw_events, list):
        raise MalformedPayload("batch ts/events have the wrong types")
    batch = EngineBatch(ts=float(ts), dp_rank=dp_rank if _is_int(dp_rank) else None)
    for raw in raw_events:
        try:
            event = event_from_obj(raw)
        except _BadEvent:
            batch.malformed += 1
            continue
        if event is None:
            batch.ignored += 1
        else:
            batch.events.append(event)
    return batch


def event_from_obj(raw: Any) -> EngineEvent | None:
    """One event in either shape; None for a well-formed event of an unknown type."""
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, fields = raw[0], _positional(raw)
    else:
        raise _BadEvent("event is neither a tagged map nor a tagged array")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    if tag == "AllBlocksCleared":
        return EngineCleared()
    if isinstance(tag, str):
        return None
    raise _BadEvent("event tag missing")


def _positional(raw: list[Any]) -> dict[str, Any]:
    names = STORED_FIELDS if raw[0] == "BlockStored" else REMOVED_FIELDS
    required = STORED_REQUIRED if raw[0] == "BlockStored" else REMOVED_REQUIRED
    if raw[0] in ("BlockStored", "BlockRemoved") and len(raw) - 1 < required:
        raise _BadEvent("positional event too short")
    return dict(zip(names, raw[1:], strict=False))


def _stored(f: dict[str, Any]) -> EngineStored:
    if "block_hashes" not in f or "token_ids" not in f:
        raise _BadEvent("BlockStored without block_hashes/token_ids")
    token_ids = f["token_ids"]
    block_size = f.get("block_size", 0)
    if not isinstance(token_ids, list) or not _is_int(block_size) or block_size < 0:
        raise _BadEvent("BlockStored token_ids/block_size")
    parent = f.get("parent_block_hash")
    extra = f.get("extra_keys")
    group = f.get("group_idx")
    return EngineStored(
        hashes=_hashes(f["block_hashes"]),
        parent=None if parent is None else _hash(parent),
        token_ids=token_ids,
        block_size=block_size,
        medium=_opt_str(f.get("medium")),
        locality=_opt_str(f.get("locality")),
        lora_name=_opt_str(f.get("lora_name")),
        extra_keys=extra if isinstance(extra, list) else None,
        group_idx=group if _is_int(group) else None,
    )


def _removed(f: dict[str, Any]) -> EngineRemoved:
    if "block_hashes" not in f:
        raise _BadEvent("BlockRemoved without block_hashes")
    group = f.get("group_idx")
    return EngineRemoved(
        hashes=_hashes(f["block_hashes"]),
        medium=_opt_str(f.get("medium")),
        locality=_opt_str(f.get("locality")),
        group_idx=group if _is_int(group) else None,
    )


def _hashes(raw: Any) -> list[EngineHash]:
    if not isinstance(raw, list) or not raw:
        raise _BadEvent("block_hashes must be a non-empty list")
    return [_hash(h) for h in raw]


def _hash(h: Any) -> EngineHash:
    """uint64 int (negative ints from old signed hashes wrap), bytes, or hex text (JSON)."""
    if type(h) is int:
        return h & MASK64
    if isinstance(h, str):
        try:
            h = bytes.fromhex(h)
        except ValueError:
            raise _BadEvent("block hash text is not hex") from None
    if isinstance(h, bytes):
        # Kept as an engine-map key, whose memory bound (ENTRY_BYTES) assumes a digest.
        if len(h) > MAX_HASH_BYTES:
            raise _BadEvent("block hash longer than any engine hash")
        return h
    raise _BadEvent("block hash is not an int or bytes")


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)
