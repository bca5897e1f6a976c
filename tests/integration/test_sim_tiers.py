"""The simulated pod's L1 and shared-directory L2 over real HTTP, ZMQ and files.

Pods are subprocesses (``bench.sim.launch``); two of them share one L2 directory.
Expected hashes come from the engine hasher with known seeds; event payloads are
decoded with plain ``msgspec.msgpack`` as a gateway would.
"""

import re
import time

import httpx
import msgspec
import pytest
import zmq

from bench.profiles import get_profile
from bench.sim.hashing import EngineHasher, external_hash
from bench.sim.launch import sim_fleet

BS = 32
SEED = "tiers-seed"
MODEL = "kvgate-tiny-llama"


def prompt_of(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt) % 2000 + 10 for i in range(n)]


def complete(pod, prompt, max_tokens=1):
    body = {"prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(pod.url + "/v1/completions", json=body, timeout=30).json()["usage"]


def ttft(pod, prompt) -> float:
    body = {"prompt": prompt, "max_tokens": 1, "stream": True}
    start = time.perf_counter()
    elapsed = 0.0
    with httpx.stream("POST", pod.url + "/v1/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if not elapsed and line.startswith("data: {"):
                elapsed = time.perf_counter() - start
    return elapsed


def metric(pod, name: str) -> float:
    text = httpx.get(pod.url + "/metrics").text
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


class Subscriber:
    def __init__(self, pod):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(pod.events_endpoint)
        for i in range(100):  # until joined, then drain
            complete(pod, [1900 - i] * BS + [1])
            if self.sock.poll(100):
                break
        while self.sock.poll(300):
            self.sock.recv_multipart()

    def events(self, timeout_ms=1500) -> list[dict]:
        out = []
        while self.sock.poll(timeout_ms):
            _, _, payload = self.sock.recv_multipart()
            out += msgspec.msgpack.decode(payload)[1]
            timeout_ms = 300
        return out

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def evict_pod():
    overrides = dict(l0_capacity_blocks=4, l1_capacity_blocks=64, l1_policy="evict")
    with sim_fleet(1, kv_events=True, hash_seed=SEED, **overrides) as pods:
        yield pods[0]


def test_write_through_l1_publishes_one_tokenless_cpu_event_per_gpu_block():
    with sim_fleet(1, kv_events=True, hash_seed=SEED, l1_capacity_blocks=64) as (pod,):
        sub = Subscriber(pod)
        prompt = prompt_of(2 * BS + 1, 1)
        complete(pod, prompt)
        events = sub.events()
        sub.close()
    hashes = [external_hash(h) for h in EngineHasher(SEED, BS).block_hashes(prompt)]
    gpu = [e for e in events if e["medium"] == "GPU"]
    cpu = [e for e in events if e["medium"] == "CPU"]
    assert [e["block_hashes"] for e in gpu] == [hashes]
    assert sorted(h for e in cpu for h in e["block_hashes"]) == sorted(hashes)
    assert cpu[0] == {
        "type": "BlockStored",
        "block_hashes": cpu[0]["block_hashes"],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert len(cpu) == 2


def test_evict_policy_offloads_l0_evictions_and_serves_them_back_from_l1(evict_pod):
    a, b = prompt_of(3 * BS + 1, 2), prompt_of(3 * BS + 1, 3)
    complete(evict_pod, a)
    complete(evict_pod, b)  # L0 holds 4 blocks: a's tail two go to L1
    hits_before = metric(evict_pod, "vllm:external_prefix_cache_hits_total")
    usage = complete(evict_pod, a)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    assert metric(evict_pod, "vllm:external_prefix_cache_hits_total") - hits_before == 2 * BS
    state = httpx.get(evict_pod.url + "/sim/state").json()
    assert [t["name"] for t in state["tiers"]] == ["L0", "L1"]
    assert state["cached_tokens_by_tier"]["L1"] == 2 * BS


@pytest.fixture(scope="module")
def l2_pair(tmp_path_factory):
    l2_dir = tmp_path_factory.mktemp("l2")
    with sim_fleet(2, kv_events=True, profile="original", l2_dir=l2_dir,
                   default_max_tokens=1) as pods:  # fmt: skip
        yield pods, l2_dir


def test_original_profile_cross_pod_l2_hit_is_2_7x_faster_at_2500_tokens(l2_pair):
    (pod_a, pod_b), _ = l2_pair
    colds, hits = [], []
    for salt in (40, 41, 42):  # fresh prompts; the minimum filters scheduling noise
        prompt = prompt_of(2500, salt)
        colds.append(ttft(pod_a, prompt))  # computes and writes through to the shared dir
        hits.append(ttft(pod_b, prompt))  # other pod, cold L0/L1: served from L2
    cold, hit = min(colds), min(hits)
    # What HTTP, JSON and hashing add on this (shared, busy) machine is not part of
    # the model: measure it on L0 repeats, whose modelled TTFT is alpha + 4 tokens.
    timing = get_profile("original").timing
    loaded = (2500 - 1) // BS * BS
    warm_model = timing.compute_s(2500 - loaded)
    overhead = min(ttft(pod_b, prompt) for _ in range(3)) - warm_model
    assert 0 <= overhead < 0.15
    cold_model = timing.compute_s(2500)
    hit_model = timing.load_s(0, loaded) + warm_model
    assert (cold_model, hit_model) == pytest.approx((0.774, 0.288), rel=0.01)
    assert cold - overhead == pytest.approx(cold_model, rel=0.15)
    assert hit - overhead == pytest.approx(hit_model, rel=0.15)
    assert (cold - overhead) / (hit - overhead) == pytest.approx(2.7, rel=0.15)
    state = httpx.get(pod_b.url + "/sim/state").json()
    l2_tokens = (state["cached_tokens_by_tier"]["L2"], state["l2_cross_pod_tokens"])
    assert l2_tokens == (3 * loaded, 3 * loaded)
    assert metric(pod_b, "vllm:external_prefix_cache_hits_total") == 3 * loaded
    assert metric(pod_b, "vllm:prefix_cache_hits_total") == 3 * loaded  # the L0 repeats


def test_l2_files_are_named_by_the_fleet_seed_hash_and_hold_the_writer(l2_pair):
    (pod_a, _), l2_dir = l2_pair
    prompt = prompt_of(3 * BS + 1, 5)
    sub = Subscriber(pod_a)
    complete(pod_a, prompt)
    events = sub.events()
    sub.close()
    names = EngineHasher("kvgate-l2", BS).block_hashes(prompt)
    assert all((l2_dir / h.hex()).read_text() == f"127.0.0.1:{pod_a.port}" for h in names)
    storage = [e for e in events if e["medium"] == "STORAGE"]
    gpu_hashes = [h for e in events if e["medium"] == "GPU" for h in e["block_hashes"]]
    assert len(storage) == 3 and all(e["locality"] == "REMOTE" for e in storage)
    assert [e["block_hashes"][0] for e in storage] == gpu_hashes  # GPU hash space
    assert all((e["token_ids"], e["block_size"]) == ([], 0) for e in storage)


def test_lmcache_fs_mode_shares_l2_without_publishing_storage_events(tmp_path):
    with sim_fleet(2, kv_events=True, l2_dir=tmp_path, l2_events="none") as (a, b):
        sub = Subscriber(a)
        prompt = prompt_of(4 * BS + 1, 6)
        complete(a, prompt)
        events = sub.events()
        sub.close()
        usage = complete(b, prompt)
    assert {e["medium"] for e in events} == {"GPU"}
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * BS
