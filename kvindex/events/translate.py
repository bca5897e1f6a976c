"""Engine events → ``IndexOp``s over router keys, for one pod (and DP rank).

Keys are computed with the pod's ``BlockKeyer`` from each ``BlockStored``'s token ids,
chained from the router key of its ``parent_block_hash`` (or from the root seeded by
``lora_name`` and the cache salt of the first block when there is no parent), and
remembered in the ``EngineKeyMap`` so hash-only events can be resolved later.

Every skip is counted: unknown hashes (``kvgate_kv_unknown_hashes_total``), a block
size that differs from the configured one (``kvgate_kv_block_size_mismatches_total``,
logged once per pod and size pair), malformed events (decode errors).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from kvindex.events.engine_map import DEFAULT_CAPACITY, EngineKeyMap, key_list, positions, tail
from kvindex.events.types import EngineBatch, EngineCleared, EngineRemoved, EngineStored
from kvindex.events.vllm_adapter import tier_of
from kvindex.keyer import BlockKeyer, chain_packed, pack_tokens
from kvindex.metrics import EventMetrics, normalize_medium
from kvindex.store import Cleared, IndexOp, Positions, Removed, Stored, chain_positions
from kvindex.types import Tier

log = logging.getLogger(__name__)

POD_TIERS = (Tier.L0, Tier.L1)  # what AllBlocksCleared and a restart drop
_LOGGED_MISMATCHES_CAPACITY = 1024


@dataclass(slots=True)
class TranslateStats:
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    unknown_hashes: int = 0
    malformed: int = 0
    ignored: int = 0  # unknown types, media, or KV-cache groups other than the indexed ones
    size_mismatches: int = 0


def cache_salt_of(extra_keys: list[Any] | None, lora_name: str | None) -> str | None:
    """The cache salt vLLM put into the first block's extra keys, if any.

    vLLM publishes per block ``(lora_name?, (mm_id, offset)..., cache_salt?,
    prompt_embeds_digest?)`` untagged (``to_event_extra_keys``), and only the block
    that starts at token 0 carries the salt. So: the first string of the first entry
    after the LoRA name (when a LoRA is set); mm pairs are arrays, digests bytes.
    """
    if not extra_keys or not isinstance(extra_keys[0], list | tuple):
        return None
    strings = [k for k in extra_keys[0] if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


class EventTranslator:
    """Stateful translator of one pod's (DP rank's) event stream."""

    def __init__(
        self,
        pod: str,
        keyer: BlockKeyer,
        metrics: EventMetrics | None = None,
        map_capacity: int = DEFAULT_CAPACITY,
        groups: frozenset[int] = frozenset({0}),
    ) -> None:
        self.pod = pod
        self.keyer = keyer
        self.metrics = metrics if metrics is not None else EventMetrics()
        self.map = EngineKeyMap(map_capacity)
        self.groups = groups  # KV-cache groups indexed (0: the full-attention group)
        self.stats = TranslateStats()
        self._logged_sizes: set[int] = set()
        m = self.metrics
        self._unknown = m.unknown_hashes.labels(pod=pod)
        self._mismatch = m.block_size_mismatches.labels(pod=pod)
        self._decode_errors = m.decode_errors.labels(pod=pod)
        # ``events_applied``'s children by (type, normalized medium): a bounded set (3
        # types x 5 media), looked up once each instead of per event (``labels()``
        # was 13% of a replayed history's apply time).
        self._applied: dict[tuple[str, str], Counter] = {}

    def reset(self) -> None:
        """Forget learned hashes (engine restarted: its hashes may be seeded anew)."""
        self.map.clear()

    def translate(self, batch: EngineBatch) -> list[IndexOp]:
        """Ops for one batch, consecutive same-kind ops of one tier merged."""
        if batch.malformed:
            self.stats.malformed += batch.malformed
            self._decode_errors.inc(batch.malformed)
        self.stats.ignored += batch.ignored
        ops: list[IndexOp] = []
        for event in batch.events:
            self.stats.events += 1
            if isinstance(event, EngineStored):
                op: IndexOp | None = self._stored(event)
            elif isinstance(event, EngineRemoved):
                op = self._removed(event)
            else:
                op = self._cleared(event)
            if op is not None:
                _append_merged(ops, op)
        return ops

    def _count(self, kind: str, medium: str | None) -> None:
        key = (kind, normalize_medium(medium))
        child = self._applied.get(key)
        if child is None:
            child = self.metrics.events_applied.labels(type=kind, medium=key[1], pod=self.pod)
            self._applied[key] = child
        child.inc()

    def _indexed(self, group_idx: int | None) -> bool:
        return group_idx is None or group_idx in self.groups

    def _stored(self, ev: EngineStored) -> Stored | None:
        tier = tier_of(ev.medium, ev.locality)
        if tier is None or not self._indexed(ev.group_idx):
            self.stats.ignored += 1
            return None
        if ev.block_size and ev.block_size != self.keyer.block_size:
            self._size_mismatch(ev.block_size)
        keys, pos = self._learn(ev, tier) if ev.token_ids else self._resolve(ev.hashes, tier)
        if not keys:
            return None
        self.stats.blocks_stored += len(keys)
        self._count("BlockStored", ev.medium)
        return Stored(tier, keys, pos)

    def _removed(self, ev: EngineRemoved) -> Removed | None:
        tier = tier_of(ev.medium, ev.locality)
        if tier is None or not self._indexed(ev.group_idx):
            self.stats.ignored += 1
            return None
        keys, pos = self._resolve(ev.hashes, tier, removed=True)
        if not keys:
            return None
        self.stats.blocks_removed += len(keys)
        self._count("BlockRemoved", ev.medium)
        return Removed(tier, keys, pos)

    def _cleared(self, ev: EngineCleared) -> Cleared:
        self._count("AllBlocksCleared", None)
        self.map.release_all(POD_TIERS)
        return Cleared(POD_TIERS)

    def _learn(self, ev: EngineStored, tier: Tier) -> tuple[list[int], Positions | None]:
        """Router keys (and their chain positions) of a BlockStored with tokens;
        remembers engine hash → keys."""
        size = self.keyer.block_size
        per = ev.block_size // size if ev.block_size % size == 0 else 0
        n = len(ev.hashes)
        if per == 0 or len(ev.token_ids) != n * ev.block_size:
            if per:  # the sizes agree but the token count does not: a broken event
                self.stats.malformed += 1
                self._decode_errors.inc()
            return [], None
        chained = self._chain_start(ev)
        if chained is None:
            return [], None
        seed, depth, anchor = chained
        try:
            packed = pack_tokens(ev.token_ids)
        except (OverflowError, TypeError):
            self.stats.malformed += 1
            self._decode_errors.inc()
            return [], None
        keys = chain_packed(seed, packed, size, n * per)
        pos = chain_positions(keys, depth, anchor, seed)
        learn = self.map.learn
        if per == 1:
            for i, (engine_hash, key) in enumerate(zip(ev.hashes, keys, strict=True)):
                learn(engine_hash, key, depth + i, pos.anchors[i], pos.parents[i], tier)
        else:
            for i, engine_hash in enumerate(ev.hashes):
                j = i * per
                block = tuple(keys[j : j + per])
                learn(engine_hash, block, depth + j, pos.anchors[j], pos.parents[j], tier)
        return keys, pos

    def _chain_start(self, ev: EngineStored) -> tuple[int, int, int] | None:
        """(key the first block chains from, first block's depth, the parent's group
        anchor), or None when the parent is unknown."""
        if ev.parent is None:
            salt = cache_salt_of(ev.extra_keys, ev.lora_name)
            return self.keyer.root_for(ev.lora_name, salt), 0, 0
        found = self.map.entry(ev.parent)
        if found is None:  # parent evicted or learnt before we joined: cannot chain
            self._unknown_hashes(len(ev.hashes))
            return None
        key, depth, anchor = tail(found)
        return key, depth + 1, anchor

    def _resolve(
        self, hashes: list[Any], tier: Tier, removed: bool = False
    ) -> tuple[list[int], Positions]:
        """Keys of hash-only events, marking the tier held (or released, ``removed``)."""
        keys: list[int] = []
        offsets: list[int] = []
        anchors: list[int] = []
        parents: list[int] = []
        unknown = 0
        mark = self.map.release if removed else self.map.hold
        for engine_hash in hashes:
            found = mark(engine_hash, tier)
            if found is None:
                unknown += 1
                continue
            pos = positions(found)
            keys += key_list(found)
            offsets += pos.offsets
            anchors += pos.anchors
            parents += pos.parents
        if unknown:
            self._unknown_hashes(unknown)
        return keys, Positions(offsets, anchors, parents)

    def _unknown_hashes(self, n: int) -> None:
        self.stats.unknown_hashes += n
        self._unknown.inc(n)

    def _size_mismatch(self, event_size: int) -> None:
        self.stats.size_mismatches += 1
        self._mismatch.inc()
        if (
            event_size in self._logged_sizes
            or len(self._logged_sizes) > _LOGGED_MISMATCHES_CAPACITY
        ):
            return
        self._logged_sizes.add(event_size)
        handled = event_size % self.keyer.block_size == 0
        log.warning(
            "pod %s: event block size %d differs from configured %d for model %s (%s)",
            self.pod,
            event_size,
            self.keyer.block_size,
            self.keyer.model,
            "mapped onto router blocks" if handled else "events with tokens skipped",
        )


def _append_merged(ops: list[IndexOp], op: IndexOp) -> None:
    """Merge ``op`` into the previous op when both store (or remove) in the same tier."""
    if ops and not isinstance(op, Cleared):
        last = ops[-1]
        if (
            type(last) is type(op)
            and last.tier == op.tier  # type: ignore[union-attr]
            and isinstance(last.keys, list)  # type: ignore[union-attr]
            and last.pos is not None  # type: ignore[union-attr]
            and op.pos is not None  # type: ignore[union-attr]
        ):
            # keys and positions are lists built by this module: extend them in place
            last.keys.extend(op.keys)  # type: ignore[union-attr]
            mine, theirs = last.pos, op.pos  # type: ignore[union-attr]
            mine.offsets.extend(theirs.offsets)  # type: ignore[attr-defined]
            mine.anchors.extend(theirs.anchors)  # type: ignore[attr-defined]
            mine.parents.extend(theirs.parents)  # type: ignore[attr-defined]
            return
    ops.append(op)
