"""KVEventSubscriber against vLLM 0.32's own ZmqEventPublisher (PUB + replay ROUTER).

The publisher runs in vLLM's venv (``~/.cache/kvgate/vllm-venv``, docs/vllm.md) and
publishes real ``KVEventBatch``es on command; skipped where that venv is missing.
Three batches go out before the subscriber connects, so the test also proves the
bootstrap replay against vLLM's ROUTER and its reply/end-marker framing.
"""

import asyncio
import os
from pathlib import Path

import pytest

from bench.polling import wait_for_async
from bench.ports import free_port
from kvindex.events.subscriber import KVEventSubscriber
from kvindex.keyer import BlockKeyer
from kvindex.store import Stored
from tests.recording_store import RecordingStore

VLLM_PYTHON = Path(
    os.environ.get("KVGATE_VLLM_PYTHON", Path.home() / ".cache/kvgate/vllm-venv/bin/python")
)
PUBLISHER = """
import sys, time
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
port, replay_port = int(sys.argv[1]), int(sys.argv[2])
pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}",
                        replay_endpoint=f"tcp://*:{replay_port}", topic="kv")
print("ready", flush=True)
for line in sys.stdin:
    i = int(line)
    pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[2**63 + i], parent_block_hash=2**63 + i - 1 if i else None,
        token_ids=list(range(4 * i, 4 * i + 4)), block_size=4, lora_id=None,
        medium="GPU", lora_name=None)]))
    time.sleep(0.05)
    print("published", i, flush=True)
pub.shutdown()
"""


@pytest.mark.e2e
async def test_subscriber_follows_vllms_own_publisher_including_bootstrap_replay():
    if not VLLM_PYTHON.exists():
        pytest.skip("needs the vLLM venv (make test installs it; docs/vllm.md)")
    port, replay_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        str(VLLM_PYTHON), "-c", PUBLISHER, str(port), str(replay_port),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip

    async def publish(i):
        proc.stdin.write(f"{i}\n".encode())
        await proc.stdin.drain()
        while not (await proc.stdout.readline()).startswith(b"published"):
            pass

    keyer, store = BlockKeyer("tiny", 4), RecordingStore()
    sub = KVEventSubscriber(
        "vllm-pod", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}",
        keyer, store, topic="kv",
    )  # fmt: skip
    try:
        while not (await asyncio.wait_for(proc.stdout.readline(), 120)).startswith(b"ready"):
            pass
        for i in range(3):
            await publish(i)
        await sub.start()
        await wait_for_async(lambda: sub.stats[0]["connected"], timeout=10.0)
        await asyncio.sleep(0.3)
        await publish(3)
        await wait_for_async(lambda: sub.stats[0]["last_seq"] == 3, timeout=10.0)
    finally:
        await sub.stop()
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
    keys = [k for op in store.ops() if isinstance(op, Stored) for k in op.keys]
    assert keys == keyer.keys(list(range(16)))
    assert sub.stats[0]["replays"] == 1 and sub.stats[0]["replayed_batches"] == 4
