"""Engine-space KV events: what the engine said, before mapping to router keys.

Adapters (``vllm_adapter``) produce these from the wire; ``translate`` turns them into
``IndexOp``s over router keys. Hashes stay in the engine's own space: ``int`` (uint64,
normalised to 0..2**64-1) or ``bytes`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EngineHash = int | bytes


@dataclass(slots=True)
class EngineStored:
    hashes: list[EngineHash]
    parent: EngineHash | None
    token_ids: list[int]  # all blocks' tokens concatenated; empty for tokenless offload events
    block_size: int  # 0 for vLLM native offload placeholders
    medium: str | None = None
    locality: str | None = None  # "LOCAL"/"REMOTE" for STORAGE; None = unspecified
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block; cache salt in the first
    group_idx: int | None = None


@dataclass(slots=True)
class EngineRemoved:
    hashes: list[EngineHash]
    medium: str | None = None
    locality: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class EngineCleared:
    """AllBlocksCleared: the engine dropped its whole prefix cache (reset_prefix_cache)."""


EngineEvent = EngineStored | EngineRemoved | EngineCleared


@dataclass(slots=True)
class EngineBatch:
    ts: float
    events: list[EngineEvent] = field(default_factory=list)
    dp_rank: int | None = None
    malformed: int = 0  # events in the batch that could not be decoded (skipped)
    ignored: int = 0  # well-formed events of a type this gateway does not use
