"""Router block keys: chained 64-bit xxh3 hashes over full blocks of token ids.

The gateway keys blocks itself instead of reproducing the engine's hash (sha256 over
pickle/cbor, seeded per process in older vLLM): the engine's hashes are learned and
mapped onto these keys from ``BlockStored`` events (``kvindex.events.engine_map``).

Definition (stable; other gateway replicas and the Redis index rely on it)::

    root   = xxh3_64(b"kvgate-v1" + field(model) + field(lora_name) + field(cache_salt))
    key_0  = xxh3_64(le_u64(root)    + le_u32[tokens of block 0])
    key_i  = xxh3_64(le_u64(key_i-1) + le_u32[tokens of block i])

``field(None)`` is ``b"\\x00"``; ``field(s)`` is ``b"\\x01" + le_u32(len) + utf8(s)``, so
``None`` and ``""`` differ and no two field tuples collide by concatenation. Only full
blocks are keyed: vLLM caches (and reports) full blocks only. The salt seeds the root,
so it changes every key of the chain, exactly as vLLM's ``cache_salt`` (first block's
extra key) changes every engine hash after it.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

from kvindex.lru import BoundedLRU
from kvindex.types import Bound

_XXH3 = xxhash.xxh3_64_intdigest
_LE_U64 = struct.Struct("<Q")
_ROOT_TAG = b"kvgate-v1"
ROOT_CACHE_CAPACITY = 4096  # distinct (model, lora, salt) roots remembered by a process
# A salt is the client's to choose (any length the body allows): only pairs this short
# are remembered, or a thousand salts of megabytes each would all stay in memory.
ROOT_CACHE_MAX_CHARS = 64
ROOT_BYTES = 340  # a (model, lora, salt) key tuple of up to 64 characters, its root and LRU node
# Prompts' heads are remembered in whole groups of GROUP_BLOCKS blocks (``BlockKeyer``).
GROUP_BLOCKS = 16
HEAD_KEYS = 1 << 18  # keys of remembered heads, all keyers: ~2,600 prompts of 100 blocks
HEAD_KEY_BYTES = 50  # a key in a remembered head, its share of the entry (tracemalloc)
MASK64 = (1 << 64) - 1


def _field(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8", "surrogatepass")
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def root_key(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The chain seed for one (model, LoRA, salt): the 'parent' of block 0."""
    return _XXH3(_ROOT_TAG + _field(model) + _field(lora_name) + _field(cache_salt))


# Token ids are keyed as uint32 (``pack_tokens``); anything outside cannot be a
# vocabulary entry.
TOKEN_ID_LIMIT = 1 << 32


def is_token_id(x: object) -> bool:
    """Whether ``x`` is an int that ``pack_tokens`` can key."""
    return type(x) is int and 0 <= x < TOKEN_ID_LIMIT


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as a little-endian uint32 array (raises OverflowError/TypeError on bad ids)."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        packed = token_ids  # already packed (tokenization's assembled ids)
    else:
        packed = array("I", token_ids)
    if sys.byteorder != "little":  # pragma: no cover - all supported hosts are little-endian
        packed.byteswap()
    return packed.tobytes()


def chain_packed(parent: int, packed: bytes, block_size: int, n_blocks: int) -> list[int]:
    """Keys of ``n_blocks`` consecutive blocks of ``packed`` tokens, chained from ``parent``."""
    step = 4 * block_size
    pack_parent = _LE_U64.pack
    keys: list[int] = []
    for start in range(0, n_blocks * step, step):
        parent = _XXH3(pack_parent(parent) + packed[start : start + step])
        keys.append(parent)
    return keys


class KeyerCaches:
    """What keyers remember, the roots of (model, LoRA, salt) and prompts' heads, in
    one budget for every keyer that shares it. A gateway keys each model its pods serve,
    and the pods choose those models: a budget per keyer would grow with what pods
    announce, one shared budget does not. Roots are keyed by their model, heads by a
    digest of the root (which covers the model), the block size and the tokens."""

    def __init__(self, roots: int = ROOT_CACHE_CAPACITY, head_keys: int = HEAD_KEYS) -> None:
        self.roots: BoundedLRU[tuple[str, str | None, str | None], int] = BoundedLRU(roots)
        # digest of a root, block size and tokens -> the keys of those tokens (whole groups)
        self.heads: BoundedLRU[int, tuple[int, ...]] = BoundedLRU(head_keys, weigh=len)

    def bounds(self) -> dict[str, Bound]:
        return {
            "keyer_roots": Bound(len(self.roots), self.roots.capacity, "roots", ROOT_BYTES),
            "keyer_heads": Bound(self.heads.size, self.heads.capacity, "keys", HEAD_KEY_BYTES),
        }


class BlockKeyer:
    """Token ids → chained router keys for one model and block size.

    ``BlockKeyer(model, block_size, lora_name, cache_salt)`` fixes the default root;
    ``keys_for`` takes another LoRA/salt per call (roots are cached, bounded).

    A conversation's next turn, or another question on a RAG document, repeats a
    prompt's leading blocks, and keying them again is a Python step per block (~0.3
    µs, ~30 µs for a 100-block prompt). So each prompt's keys up to its last whole
    group of ``GROUP_BLOCKS`` blocks (its *head*) are remembered under a 128-bit digest
    of the root and those tokens. A prompt's digests at every group end come from one
    streaming xxh3 pass (C); the longest one remembered gives its first keys, and only
    the blocks after them are keyed. One entry per prompt, not per group, keeps a new
    prompt's cost to that pass and one insert. The digest covers everything a key
    depends on, so remembered keys are the keys (``tests/unit/test_keyer.py``).

    Roots and heads are kept in ``caches``, which keyers of other models may share
    (``KeyerCaches``); without one, the keyer has its own.
    """

    def __init__(
        self,
        model: str,
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        head_keys: int = HEAD_KEYS,
        caches: KeyerCaches | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.caches = caches if caches is not None else KeyerCaches(head_keys=head_keys)
        self._roots = self.caches.roots
        self._heads = self.caches.heads
        # Heads of keyers sharing ``caches`` differ by root, and by block size: the same
        # tokens from the same root are other keys in blocks of another size.
        self._head_seed = block_size.to_bytes(4, "little")
        self.root = self.root_for(lora_name, cache_salt)

    def root_for(self, lora_name: str | None, cache_salt: str | None) -> int:
        """Root seed for this model with the given LoRA and salt (LRU-cached, when short)."""
        if len(lora_name or "") + len(cache_salt or "") > ROOT_CACHE_MAX_CHARS:
            return root_key(self.model, lora_name, cache_salt)  # costs what hashing the key would
        key = (self.model, lora_name, cache_salt)
        root = self._roots.touch(key)
        if root is None:
            root = root_key(self.model, lora_name, cache_salt)
            self._roots.put(key, root)
        return root

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """Keys of every full block of ``token_ids`` under the default root."""
        return self.chain(self.root, token_ids)

    def keys_for(
        self, token_ids: Sequence[int], lora_name: str | None, cache_salt: str | None
    ) -> list[int]:
        """Keys of every full block for a request with its own LoRA and salt."""
        return self.chain(self.root_for(lora_name, cache_salt), token_ids)

    def chain(self, parent: int, token_ids: Sequence[int]) -> list[int]:
        """Keys of the full blocks of ``token_ids`` continuing a chain after ``parent``."""
        n_blocks = len(token_ids) // self.block_size
        if n_blocks == 0:
            return []
        packed = pack_tokens(token_ids[: n_blocks * self.block_size])
        if n_blocks < GROUP_BLOCKS:
            return chain_packed(parent, packed, self.block_size, n_blocks)
        return self._chain_grouped(parent, packed, n_blocks)

    def _chain_grouped(self, parent: int, packed: bytes, n_blocks: int) -> list[int]:
        """``chain`` from the longest remembered head (see the class docstring)."""
        size = 4 * self.block_size * GROUP_BLOCKS
        full = n_blocks // GROUP_BLOCKS
        view = memoryview(packed)
        digest = xxhash.xxh3_128(_LE_U64.pack(parent) + self._head_seed)
        ends: list[int] = []  # digest of the root and the tokens up to each group's end
        for g in range(full):
            digest.update(view[g * size : (g + 1) * size])
            ends.append(digest.intdigest())
        heads = self._heads
        head: tuple[int, ...] = ()
        for end in reversed(ends):
            if heads.get(end) is not None:  # a miss costs a C call, not an exception
                head = heads.touch(end) or ()
                break
        keys = list(head)
        at = len(keys)
        if at < n_blocks:
            parent = keys[-1] if keys else parent
            keys += chain_packed(parent, packed[at * 4 * self.block_size :], self.block_size,
                                 n_blocks - at)  # fmt: skip
        if at < full * GROUP_BLOCKS:
            self._heads.put(ends[-1], tuple(keys[: full * GROUP_BLOCKS]))
        return keys
