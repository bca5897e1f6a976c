"""Engine block hashes, computed the way vLLM 0.32 computes them.

``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens`` hashes the tuple
``(parent_block_hash, tuple(block_token_ids), extra_keys)`` with the configured
hash function (default ``sha256`` over ``pickle.dumps(..., HIGHEST_PROTOCOL)``);
the first block's parent is ``NONE_HASH = hash_fn(seed)``. Only full blocks are
hashed. ``extra_keys`` is ``None`` unless the block needs one: a LoRA adapter's
name is in every block's, a ``cache_salt`` in the *first* block's only (so it
changes every chained hash after it). Events carry ``maybe_convert_block_hash``: the digest's
last 8 bytes as a big-endian uint64 (or the raw digest when int hashes are off).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

BlockHash = bytes  # the full 32-byte digest, as the engine keys its cache
_U64 = (1 << 64) - 1


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def external_hash(block_hash: BlockHash) -> int:
    """The uint64 a vLLM KV event carries for ``block_hash``."""
    return int.from_bytes(block_hash, "big") & _U64


class EngineHasher:
    """Chained block hashes for one simulated engine process."""

    __slots__ = ("block_size", "none_hash")

    def __init__(self, seed: str, block_size: int) -> None:
        self.block_size = block_size
        self.none_hash: BlockHash = _sha256(seed)

    def extra_keys(
        self, block_index: int, cache_salt: str | None, lora_name: str | None = None
    ) -> tuple[Any, ...] | None:
        """vLLM's ``generate_block_hash_extra_keys`` for text-only requests: the LoRA
        name, then (first block only) the salt."""
        keys: list[tuple[str, str]] = []
        if lora_name:
            keys.append(("lora_name", lora_name))
        if block_index == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) or None

    def block_hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        prior: Sequence[BlockHash] = (),
        lora_name: str | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids`` not already in ``prior``.

        ``prior`` holds the hashes of the leading blocks computed earlier (the
        prompt's), so decode-filled blocks extend the same chain.
        """
        bs = self.block_size
        out: list[BlockHash] = []
        parent = prior[-1] if prior else None
        for index in range(len(prior), len(token_ids) // bs):
            block = tuple(token_ids[index * bs : (index + 1) * bs])
            extra = self.extra_keys(index, cache_salt, lora_name)
            parent = _sha256((parent or self.none_hash, block, extra))
            out.append(parent)
        return out
