"""The committed recordings in tests/data/vllm-events say what their README says.

Needs no vLLM: it reads the files, so decoder tests can trust them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from tests.e2e.kv_events import Frame, chain_from_root, events, stored_blocks

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-events"


def load(name: str) -> tuple[list[dict], list[Frame]]:
    doc = msgspec.msgpack.decode((DATA / f"vllm-0.32-{name}.msgpack").read_bytes())
    assert (doc["vllm_version"], doc["block_size"]) == ("0.32", 32)
    return doc["requests"], [Frame(*f) for f in doc["frames"]]


def test_recordings_are_small_and_numbered_0_to_11_in_order():
    names = ["chat-extend", "completions-salt", "eviction", "reset"]
    seqs = [f.seq for n in names for f in load(n)[1]]
    assert seqs == list(range(12))
    assert sum(p.stat().st_size for p in DATA.glob("*.msgpack")) < 200_000


def test_chat_extend_chains_across_events_to_the_longer_prompt():
    requests, frames = load("chat-extend")
    ids = requests[1]["token_ids"]
    chain = chain_from_root(stored_blocks(frames), ids[:32])
    assert [t for b in chain for t in b.token_ids] == ids[: len(ids) // 32 * 32]
    assert requests[1]["cached_tokens"] == len(requests[0]["token_ids"]) // 32 * 32


def test_salted_blocks_carry_the_salt_on_the_first_block_only():
    requests, frames = load("completions-salt")
    assert [r["cache_salt"] for r in requests] == [None, "tenant-a", "tenant-a"]
    plain, salted = (e for e in events(frames) if e["type"] == "BlockStored")
    assert plain["token_ids"] == salted["token_ids"]
    assert salted["extra_keys"] == [["tenant-a"], None, None, None, None]
    assert not set(plain["block_hashes"]) & set(salted["block_hashes"])


def test_eviction_and_reset_publish_removed_and_cleared():
    kinds = [e["type"] for e in events(load("eviction")[1] + load("reset")[1])]
    assert kinds.count("BlockRemoved") == 2 + 10 + 16 + 16 + 17
    assert kinds[-2:] == ["AllBlocksCleared", "BlockStored"]
