"""Bounds audit: what a pod's events choose cannot grow the gateway's memory past the
bounds ``/admin/bounds`` reports."""

from __future__ import annotations

import msgspec

from kvindex.events.engine_map import EngineKeyMap
from kvindex.events.ingest import PodIngestor
from kvindex.events.subscriber import MAX_REPLAY_BYTES, KVEventSubscriber
from kvindex.events.wire import encode_seq
from kvindex.keyer import BlockKeyer
from kvindex.metrics import EventMetrics
from tests.recording_store import RecordingStore

BS = 16


def stored(engine_hash: int, block_size: int) -> bytes:
    """A batch of one BlockStored: one engine hash for a block of ``block_size`` tokens."""
    event = {"type": "BlockStored", "block_hashes": [engine_hash], "parent_block_hash": None,
             "token_ids": [engine_hash % 100] * block_size, "block_size": block_size,
             "medium": "GPU"}  # fmt: skip
    return msgspec.msgpack.encode([0.0, [event], 0])


async def test_an_engine_map_holds_its_capacity_in_router_keys_whatever_the_block_size():
    """A pod chooses its events' block size: one hash of a 64-router-block engine block
    holds 64 keys, so hashes alone bound nothing (4,096 keys under one hash were ~190 KB
    where the bound said 360 B)."""
    ing = PodIngestor("pod", BlockKeyer("m", BS), RecordingStore(), EventMetrics(),
                      map_capacity=1_000)  # fmt: skip
    for engine_hash in range(1, 101):
        await ing.apply_payload(stored(engine_hash, 64 * BS))
    engine_map = ing.translator().map
    held = sum(len(keys) for h in range(1, 101) if (keys := _keys(engine_map, h)))
    (bound,) = ing.bounds().values()
    assert held <= 1_000 and bound.size == held and bound.capacity == 1_000
    assert len(engine_map) == 15  # the 15 most recent blocks of 64 keys
    await ing.apply_payload(stored(101, 4_096 * BS))  # heavier than the whole map
    assert _keys(engine_map, 101) is None and len(engine_map) == 15


def _keys(engine_map: EngineKeyMap, engine_hash: int) -> tuple[int, ...] | None:
    keys = engine_map.get(engine_hash)
    return None if keys is None else (keys,) if isinstance(keys, int) else keys


def test_one_key_entries_still_count_one_each():
    m = EngineKeyMap(capacity=2)
    m.learn(1, 10, 0, 10, 10)
    m.learn(2, (20, 21), 0, 20, 20)  # weighs 2: the map holds it alone
    assert (m.get(1), m.get(2), m.bound().size) == (None, (20, 21), 2)
    m.learn(3, 30, 0, 30, 30)
    assert (m.get(2), m.get(3), m.bound().size, m.evictions) == (None, 30, 1, 2)


class EndlessReplay:
    """A pod's replay endpoint that answers with big batches and never ends."""

    def __init__(self, payload_bytes: int) -> None:
        self.payload = b"\x00" * payload_bytes  # one object: the test itself holds little
        self.seq = 0

    async def send_multipart(self, frames: list[bytes]) -> None:
        return None

    async def poll(self, timeout_ms: int, flags: int) -> bool:
        return True

    def receive(self, flags: int = 0) -> list[bytes]:
        self.seq += 1
        return [b"", encode_seq(self.seq), self.payload]


async def test_a_replay_holds_at_most_its_byte_bound_whatever_the_pod_sends():
    """The batch bound alone let a replay pin 20,000 frames of up to 16 MiB each."""
    sub = KVEventSubscriber("pod", "inproc://unused", "inproc://unused-replay",
                            BlockKeyer("m", BS), RecordingStore(), replay_max_batches=1_000,
                            replay_max_bytes=64 * 2**20)  # fmt: skip
    st = sub._ranks[0]
    pod = EndlessReplay(2**20)
    replayed = await sub._read_replay(st, pod, pod.receive, 0)  # type: ignore[arg-type]
    assert sum(map(len, replayed.values())) <= 64 * 2**20
    assert len(replayed) == 64 and st.stats.replays_cut == 1
    assert MAX_REPLAY_BYTES == 256 * 2**20  # the default
