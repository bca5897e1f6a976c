"""The simulated pod's KV events over real ZMQ sockets, and its LRU capacity.

Expected hashes come from the engine hasher with the pod's fixed seed; payloads
are decoded with plain ``msgspec.msgpack`` (no sim types), as a gateway would.
"""

import time

import httpx
import msgspec
import pytest
import zmq

from bench.sim.hashing import EngineHasher, external_hash
from bench.sim.launch import sim_fleet

BS = 32
SEED = "events-seed"
END = b"\xff" * 8


@pytest.fixture(scope="module")
def pods():
    # Capacity 4 blocks so eviction is easy to provoke.
    with sim_fleet(1, kv_events=True, l0_capacity_blocks=4, hash_seed=SEED) as fleet:
        yield fleet[0]


@pytest.fixture(scope="module")
def old_pod():
    overrides = dict(kv_events_old_shape=True, kv_events_bytes_hashes=True, hash_seed=SEED)
    with sim_fleet(1, kv_events=True, topic="old", **overrides) as fleet:
        yield fleet[0]


def hashes(tokens, salt=None):
    return EngineHasher(SEED, BS).block_hashes(tokens, salt)


def complete(pod, prompt, max_tokens=1, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, **extra}
    return httpx.post(pod.url + "/v1/completions", json=body).json()["usage"]


class Subscriber:
    """A SUB socket that is known to be joined (ZMQ drops messages before that)."""

    def __init__(self, pod):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(pod.events_endpoint)
        for i in range(100):  # warm up until one batch arrives, then drain
            complete(pod, [1000 + i] * BS + [1])
            if self.sock.poll(100):
                break
        while self.sock.poll(200):
            self.sock.recv_multipart()

    def next(self, timeout_ms=3000):
        assert self.sock.poll(timeout_ms), "no KV event batch"
        topic, seq, payload = self.sock.recv_multipart()
        return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    def next_stored(self):
        """(seq, the batch's BlockStored) — small-capacity batches also carry removals."""
        _, seq, (_, events, _) = self.next()
        (stored,) = [e for e in events if e["type"] == "BlockStored"]
        return seq, stored

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def sub(pods):
    s = Subscriber(pods)
    yield s
    s.close()


def test_block_stored_batch_has_vllm_wire_fields(pods, sub):
    prompt = [7] * (2 * BS) + [8]
    complete(pods, prompt)
    topic, seq, (ts, events, rank) = sub.next()
    assert topic == b"kv-events" and seq > 0 and rank == 0
    assert abs(ts - time.time()) < 5
    h = [external_hash(x) for x in hashes(prompt)]
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": h,
            "parent_block_hash": None,
            "token_ids": prompt[: 2 * BS],
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None, None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    ]


def test_salted_prompt_publishes_salt_as_first_blocks_extra_key(pods, sub):
    prompt = [9] * BS + [10]
    complete(pods, prompt, cache_salt="s1")
    _, event = sub.next_stored()
    assert event["extra_keys"] == [["s1"]]
    assert event["block_hashes"] == [external_hash(hashes(prompt, "s1")[0])]


def test_decode_filled_block_is_stored_alone_with_its_parent(pods, sub):
    prompt = [11] * (BS + 20)
    complete(pods, prompt, max_tokens=13)  # 52 + 13 - 1 computed tokens: block 1 fills
    seq1, prefill = sub.next_stored()
    seq2, decoded = sub.next_stored()
    assert seq2 == seq1 + 1
    assert prefill["block_hashes"] == [external_hash(hashes(prompt)[0])]
    assert decoded["parent_block_hash"] == prefill["block_hashes"][0]
    assert decoded["token_ids"][:20] == [11] * 20 and len(decoded["token_ids"]) == BS


def test_eviction_publishes_one_block_removed_per_hash_before_the_store(pods, sub):
    a = [21] * (3 * BS) + [1]
    b = [22] * (3 * BS) + [1]
    httpx.post(pods.url + "/reset_prefix_cache")
    assert sub.next()[2][1] == [{"type": "AllBlocksCleared"}]
    complete(pods, a)  # fills 3 of the 4 blocks
    sub.next()
    complete(pods, b)  # needs 3: evicts a's tail first
    _, _, (_, events, _) = sub.next()
    ha = [external_hash(x) for x in hashes(a)]
    assert [e["type"] for e in events] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    assert events[0] == {
        "type": "BlockRemoved",
        "block_hashes": [ha[2]],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert events[1]["block_hashes"] == [ha[1]]


def test_lru_eviction_shrinks_the_cached_prefix(pods):
    a = [31] * (3 * BS) + [1]
    b = [32] * (3 * BS) + [1]
    complete(pods, a)
    assert complete(pods, a)["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    complete(pods, b)
    assert complete(pods, a)["prompt_tokens_details"]["cached_tokens"] == BS


def test_replay_over_dealer_returns_buffered_batches_then_end_marker(pods, sub):
    complete(pods, [41] * BS + [1])
    _, last, live = sub.next()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pods.replay_endpoint)
    try:
        dealer.send_multipart([b"", (last - 1).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(3000), "replay did not answer"
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == END:
                break
    finally:
        dealer.close(0)
        ctx.term()
    assert replies[-1] == [b"", b"", END, b""]
    seqs = [int.from_bytes(r[2], "big") for r in replies[:-1]]
    assert seqs[:2] == [last - 1, last]
    assert all(r[0] == b"" and r[1] == b"kv-events" for r in replies[:-1])
    assert msgspec.msgpack.decode(replies[1][3]) == live


def test_reset_prefix_cache_publishes_all_blocks_cleared(pods, sub):
    assert httpx.post(pods.url + "/reset_prefix_cache").status_code == 200
    _, _, (_, events, _) = sub.next()
    assert events == [{"type": "AllBlocksCleared"}]
    assert httpx.get(pods.url + "/sim/state").json()["tiers"][0]["blocks"] == 0


def test_old_shape_and_bytes_hashes_for_decoder_tests(old_pod):
    s = Subscriber(old_pod)
    try:
        prompt = [51] * BS + [1]
        complete(old_pod, prompt)
        topic, _, (_, events, rank) = s.next()
    finally:
        s.close()
    assert (topic, rank) == (b"old", 0)
    assert events == [["BlockStored", [hashes(prompt)[0]], None, prompt[:BS], BS, None, "GPU"]]


def test_killed_pod_restarts_on_same_ports_with_empty_cache_and_seq_from_zero(old_pod):
    prompt = [61] * BS + [1]
    complete(old_pod, prompt)
    url, events = old_pod.url, old_pod.events_endpoint
    old_pod.kill()
    old_pod.start()
    assert (old_pod.url, old_pod.events_endpoint) == (url, events)
    s = Subscriber(old_pod)  # its warm-up requests advance seq; replay shows the start
    s.close()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(old_pod.replay_endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(3000)
        assert dealer.recv_multipart()[2] == (0).to_bytes(8, "big")
    finally:
        dealer.close(0)
        ctx.term()
    assert complete(old_pod, prompt)["prompt_tokens_details"]["cached_tokens"] == 0
