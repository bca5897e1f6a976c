"""Recorded vLLM 0.32 event batches (tests/data/vllm-events/): router keys learnt from
the events equal BlockKeyer keys of the recorded token ids.

Accepted files: ``*.msgpack`` (one raw payload each) and ``*.jsonl`` (one object per
line with the payload as hex under ``payload_hex`` or ``payload``). Skipped while the
directory is empty.
"""

import json
from pathlib import Path

import pytest

from kvindex.events.ingest import PodIngestor
from kvindex.events.recording import RecordingStore
from kvindex.events.translate import cache_salt_of
from kvindex.events.types import EngineStored
from kvindex.events.vllm_adapter import decode_payload, tier_of
from kvindex.keyer import BlockKeyer
from kvindex.store import Stored

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-events"


def recorded_payloads():
    payloads = []
    for path in sorted(DATA.glob("*")) if DATA.is_dir() else []:
        if path.suffix == ".msgpack":
            payloads.append(path.read_bytes())
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                if line.strip():
                    obj = json.loads(line)
                    raw = obj.get("payload_hex") or obj.get("payload")
                    if isinstance(raw, str):
                        payloads.append(bytes.fromhex(raw))
    return payloads


def first_block_size(batches):
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, EngineStored) and ev.token_ids and ev.block_size:
                return ev.block_size
    return None


async def test_recorded_events_learn_the_keys_blockkeyer_computes():
    payloads = recorded_payloads()
    if not payloads:
        pytest.skip("no recorded vLLM batches in tests/data/vllm-events yet")
    batches = [decode_payload(p) for p in payloads]
    block_size = first_block_size(batches)
    assert block_size, "recordings contain no BlockStored with tokens"
    keyer = BlockKeyer("recorded", block_size)
    expected: list[int] = []
    prefix: dict[object, list[int]] = {}  # engine hash -> all tokens up to its block's end
    meta: dict[object, tuple] = {}  # engine hash -> (lora, salt) of its chain
    for batch in batches:
        for ev in batch.events:
            if not (isinstance(ev, EngineStored) and ev.token_ids):
                continue
            if tier_of(ev.medium, ev.locality) is None:  # Tier.L0 is 0: compare with None
                continue
            if ev.group_idx not in (None, 0) or ev.block_size != block_size:
                continue
            if ev.parent is None:
                before, chain = [], (ev.lora_name, cache_salt_of(ev.extra_keys, ev.lora_name))
            elif ev.parent in prefix:
                before, chain = prefix[ev.parent], meta[ev.parent]
            else:
                continue  # parent stored before the recording started
            tokens = before + ev.token_ids
            keys = keyer.keys_for(tokens, *chain)[len(before) // block_size :]
            expected.extend(keys)
            for i, h in enumerate(ev.hashes):
                prefix[h] = tokens[: len(before) + (i + 1) * block_size]
                meta[h] = chain
    store = RecordingStore()
    ingestor = PodIngestor("recorded-pod", keyer, store)
    for payload in payloads:
        await ingestor.apply_payload(payload)
    learnt = [k for op in store.ops() if isinstance(op, Stored) and op.keys for k in op.keys]
    assert expected
    assert set(expected) <= set(learnt)
