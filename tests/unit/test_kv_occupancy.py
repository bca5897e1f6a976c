"""What kv-aware's eviction price reads as a pod's L0 occupancy (``KvIndex.l0_blocks_now``):
the blocks a followed pod's events stored, 0 before any arrived, and nothing (None) for a
pod whose events this gateway does not follow."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from bench.ports import free_port
from gateway.config import PodConfig, Settings
from gateway.kv import KvIndex
from gateway.pods import Pod

BODY = (
    b'[1.0, [{"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": null,'
    b' "token_ids": ' + str(list(range(100, 132))).encode() + b', "block_size": 16,'
    b' "lora_id": null, "medium": "GPU", "lora_name": null}], null]'
)


def _pod(name: str, events: str | None = None) -> Pod:
    return Pod(PodConfig(name=name, url="http://127.0.0.1:9", kv_events=events, models=["m"]),
               healthy=True, models={"m"})  # fmt: skip


async def test_occupancy_is_known_only_for_pods_whose_events_are_followed():
    zmq_pod = _pod("zmq", events=f"tcp://127.0.0.1:{free_port()}")  # publishes nothing yet
    posting, silent = _pod("posting"), _pod("silent")
    settings = Settings(pods=[p.config for p in (zmq_pod, posting, silent)])
    async with httpx.AsyncClient() as client:
        kv = KvIndex(settings, CollectorRegistry(), client)
        try:
            await kv.pod_admitted(zmq_pod)
            await kv.pod_admitted(silent)  # no events endpoint: nothing to follow
            # Followed, nothing stored yet: an empty cache as far as we know.
            assert kv.l0_blocks_now("zmq") == 0
            # Not followed: it may hold anything.
            assert kv.l0_blocks_now("silent") is None
            assert kv.l0_blocks_now("posting") is None
            # A pod that posts its events is followed from its first post on.
            assert await kv.ingest_http(posting, BODY, "application/json") >= 1
            assert kv.l0_blocks_now("posting") == 2
            await kv.pod_removed("zmq")
            assert kv.l0_blocks_now("zmq") is None
        finally:
            await kv.close()
