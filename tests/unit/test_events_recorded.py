"""Real vLLM 0.32 event frames (tests/data/vllm-events/, see its README): the router
keys kvindex learns from them equal BlockKeyer keys of the requests' own token ids
(as the server's /tokenize returned them), with and without cache_salt."""

from pathlib import Path

import msgspec
import pytest

from kvindex.events.ingest import PodIngestor
from kvindex.keyer import BlockKeyer
from kvindex.store import Cleared, Removed, Stored
from kvindex.types import Tier
from tests.recording_store import RecordingStore

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-events"
FILES = sorted(DATA.glob("vllm-0.32-*.msgpack"))


def load(path: Path) -> dict:
    return msgspec.msgpack.decode(path.read_bytes())


def test_the_recordings_are_present():
    assert [p.name for p in FILES] == [
        "vllm-0.32-chat-extend.msgpack",
        "vllm-0.32-completions-salt.msgpack",
        "vllm-0.32-eviction.msgpack",
        "vllm-0.32-reset.msgpack",
    ]


async def ingest_all() -> tuple[RecordingStore, list[dict], int]:
    """All four files came from one server process: feed their frames in seq order."""
    docs = [load(p) for p in FILES]
    frames = sorted(
        (f for d in docs for f in d["frames"]), key=lambda f: int.from_bytes(f[1], "big")
    )
    block_size = docs[0]["block_size"]
    store = RecordingStore()
    ingestor = PodIngestor("pod", BlockKeyer(docs[0]["model"], block_size), store)
    for _topic, _seq, payload in frames:
        assert await ingestor.apply_payload(payload)
    requests = [r for d in docs for r in d["requests"]]
    return store, requests, block_size


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
async def test_every_recorded_request_has_its_full_blocks_learnt_as_router_keys(path):
    store, _, block_size = await ingest_all()
    doc = load(path)
    keyer = BlockKeyer(doc["model"], block_size)
    learnt = {k for op in store.ops() if isinstance(op, Stored) for k in op.keys}
    for req in doc["requests"]:
        keys = keyer.keys_for(req["token_ids"], None, req["cache_salt"])
        assert len(keys) == req["prompt_tokens"] // block_size
        assert set(keys) <= learnt, req["endpoint"]


async def test_salted_and_unsalted_prompts_learn_different_keys():
    store, _, block_size = await ingest_all()
    doc = load(DATA / "vllm-0.32-completions-salt.msgpack")
    plain, salted, _ = doc["requests"]
    assert plain["token_ids"] == salted["token_ids"]
    keyer = BlockKeyer(doc["model"], block_size)
    a = keyer.keys_for(plain["token_ids"], None, None)
    b = keyer.keys_for(salted["token_ids"], None, "tenant-a")
    assert not set(a) & set(b)


async def test_evictions_and_reset_become_removals_and_a_clear():
    store, _, _ = await ingest_all()
    ops = store.ops()
    removed = [k for op in ops if isinstance(op, Removed) for k in op.keys]
    stored = {k for op in ops if isinstance(op, Stored) for k in op.keys}
    assert removed and set(removed) <= stored  # every evicted hash mapped to a known key
    assert all(op.tier == Tier.L0 for op in ops if isinstance(op, Stored | Removed))
    assert [op.tiers for op in ops if isinstance(op, Cleared)] == [(Tier.L0, Tier.L1)]
