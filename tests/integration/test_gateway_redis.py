"""The gateway on a shared Redis index: two replicas share it; a Redis outage is survived."""

from __future__ import annotations

import httpx
import pytest

from bench.gateway_proc import run_gateway
from bench.polling import scraped, wait_for
from bench.prompts import text_of_tokens
from bench.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer
from bench.sim.launch import sim_fleet
from bench.tinymodel import ensure_tokenizer
from tests.sim_gateway import model_env

MODEL = "kvgate-tiny-llama"
BLOCK = 32
# Module-wide skip: without the binary, the sim fleet is not worth starting.
pytestmark = [pytest.mark.redis, pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)]


def _env(redis_url: str) -> dict[str, str]:
    return model_env(KVGATE_INDEX__BACKEND="redis", KVGATE_INDEX__REDIS_URL=redis_url)


def _spec(pod) -> str:
    return f"{pod.url},events={pod.events_endpoint},replay={pod.replay_endpoint}"


def _metric(url: str, name: str) -> float:
    return sum(scraped(url, name))


def _held_by(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url.admin}/admin/index/lookup", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    return r.json()["pods"]


@pytest.fixture(scope="module")
def fleet():
    with sim_fleet(2, kv_events=True, block_size=BLOCK, default_max_tokens=2) as pods:
        yield pods


def test_a_second_gateway_replica_sees_what_the_first_learnt(fleet, private_redis: RedisServer):
    env = _env(private_redis.url)
    prompt = text_of_tokens(400, seed=21, tokenizer_dir=ensure_tokenizer())
    # Replica A follows the pods' events; replica B only reads the shared index.
    with run_gateway([(p.name, _spec(p)) for p in fleet], "kv-aware", env=env) as a:
        with run_gateway([(p.name, p.url) for p in fleet], "kv-aware", env=env) as b:
            home = httpx.post(
                f"{a}/v1/completions", json={"model": MODEL, "prompt": prompt}
            ).headers["x-kvgate-pod"]
            held = wait_for(lambda: _held_by(b, prompt).get(home), poll=0.1)
            assert held["l0_blocks"] == 400 // BLOCK
            r = httpx.post(f"{b}/v1/completions", json={"model": MODEL, "prompt": prompt})
            assert r.headers["x-kvgate-pod"] == home


def test_redis_killed_mid_run_routing_continues_and_the_index_recovers(
    fleet, private_redis: RedisServer
):
    with run_gateway(
        [(p.name, _spec(p)) for p in fleet], "kv-aware", env=_env(private_redis.url)
    ) as gw:
        tok = ensure_tokenizer()
        before = text_of_tokens(300, seed=31, tokenizer_dir=tok)
        assert (
            httpx.post(f"{gw}/v1/completions", json={"model": MODEL, "prompt": before}).status_code
            == 200
        )

        private_redis.kill()
        during = text_of_tokens(300, seed=32, tokenizer_dir=tok)
        for _ in range(5):
            r = httpx.post(f"{gw}/v1/completions", json={"model": MODEL, "prompt": during})
            assert r.status_code == 200
        home = r.headers["x-kvgate-pod"]
        # The local view still answers, and it learnt the new prompt from events.
        held = wait_for(lambda: _held_by(gw, during).get(home), poll=0.1)
        assert held["l0_blocks"] == 300 // BLOCK
        assert _metric(gw, "kvgate_index_fallbacks_total") > 0
        assert _metric(gw, "kvgate_index_redis_up") == 0

        private_redis.start()  # same port, empty: the gateway must resync by itself
        wait_for(lambda: _metric(gw, "kvgate_index_redis_up") == 1, timeout=15, poll=0.1)
        held = wait_for(lambda: _held_by(gw, during).get(home), poll=0.1)  # resynced into Redis
        fallbacks = _metric(gw, "kvgate_index_fallbacks_total")
        assert _held_by(gw, during)[home]["l0_blocks"] == 300 // BLOCK
        assert _metric(gw, "kvgate_index_fallbacks_total") == fallbacks  # served by Redis
