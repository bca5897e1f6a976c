"""Worker processes and gateway replicas routing as one (``kvgate serve --workers N``,
Redis-shared load, warm start), as real processes in front of simulated pods."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from redis import Redis

from bench.gateway_proc import run_gateway
from bench.polling import scraped, wait_for
from bench.ports import free_port
from bench.prompts import text_of_tokens
from bench.redis_server import RedisServer
from bench.sim.launch import sim_fleet
from bench.tinymodel import MODEL_NAME, ensure_tokenizer
from gateway.fleet_calibration import decode_point
from tests.integration import test_gateway_kv
from tests.sim_gateway import model_env, pod_spec

MODEL = MODEL_NAME
BLOCK = 32
# The kv tests' module fixtures: two simulated pods with KV events, a 900-token prompt.
fleet = test_gateway_kv.fleet
system_prompt = test_gateway_kv.system_prompt


def _spec(pod, events: bool = True) -> str:
    return pod_spec(pod, replay=True)[1] if events else pod.url


def _env(**extra: str) -> dict[str, str]:
    return model_env(KVGATE_EXPOSE_PREDICTIONS="true", **extra)


def _chat(base: str, system: str, question: str, **body) -> httpx.Response:
    """One request on a connection of its own (as from a new client)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    with httpx.Client(timeout=30) as client:
        body = {"model": MODEL, "messages": messages, "max_tokens": 2, **body}
        r = client.post(f"{base}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def _lookup(gw, system: str) -> str | None:
    """The pod the index says holds the most of ``system``'s prompt (admin lookup)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "seed"}]
    r = httpx.post(f"{gw.admin}/admin/index/lookup", json={"model": MODEL, "messages": messages})
    pods = r.json()["pods"]
    return max(pods, key=lambda p: pods[p]["l0_blocks"]) if pods else None


def _routed(r: httpx.Response) -> tuple[str, int]:
    return r.headers["x-kvgate-pod"], int(r.headers["x-kvgate-predicted-cached-tokens"])


# -- --workers N ---------------------------------------------------------------------------


def test_two_workers_agree_on_where_a_cached_prefix_is(fleet, system_prompt):
    with run_gateway([(p.name, _spec(p)) for p in fleet], strategy="kv-aware", env=_env(),
                     workers=2) as gw:  # fmt: skip
        holder, _ = _routed(_chat(gw, system_prompt, "first"))
        wait_for(lambda: _routed(_chat(gw, system_prompt, "probe"))[1] >= 864, 10,
                 what="the prompt's events to reach the index")  # fmt: skip

        answers = []
        for i in range(16):  # new connections: the kernel spreads them over both workers
            r = _chat(gw, system_prompt, f"question {i}")
            answers.append((r.headers["x-kvgate-worker"], *_routed(r)))
        # Each worker told the other of its dispatches (the memory index's speculations).
        published = 'kvgate_worker_messages_total{outcome="published"}'
        wait_for(lambda: published in httpx.get(f"{gw}/metrics").text, 5,
                 what="the workers' message counts in /metrics")  # fmt: skip
        names = {"kvgate_worker_dropped_total", "kvgate_worker_ring_overruns_total"}
        declared = {line.split()[2] for line in httpx.get(f"{gw}/metrics").text.splitlines()
                    if line.startswith("# TYPE ")}  # fmt: skip

    assert {worker for worker, _, _ in answers} == {"0", "1"}
    assert {(pod, cached >= 864) for _, pod, cached in answers} == {(holder, True)}
    assert names <= declared


def _all_idle(gw) -> bool:
    in_flight = scraped(gw, "kvgate_pod_in_flight_requests")
    return bool(in_flight) and not any(in_flight)


def test_two_workers_send_a_prefix_aware_conversation_to_one_pod(fleet, system_prompt):
    """prefix-aware remembers in each process where it sent a prompt; the workers tell
    each other, so the turns the kernel spreads over them follow the first one, also
    where the other worker, choosing alone, would pick another pod (the least loaded,
    by name, when both are idle)."""
    hold = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 3000, "stream": True}  # fmt: skip
    with run_gateway([(p.name, _spec(p)) for p in fleet], strategy="prefix-aware", env=_env(),
                     workers=2) as gw:  # fmt: skip
        # A long answer keeps the first pod by name busy, so the first turn goes to the other.
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{gw}/v1/chat/completions", json=hold) as held,
        ):
            busy = held.headers["x-kvgate-pod"]
            first = _chat(gw, system_prompt, "first").headers["x-kvgate-pod"]
        wait_for(lambda: _all_idle(gw), 10, what="the held request to end")

        answers = []
        for i in range(16):  # new connections: the kernel spreads them over both workers
            r = _chat(gw, system_prompt, f"question {i}")
            answers.append((r.headers["x-kvgate-worker"], r.headers["x-kvgate-pod"]))

    assert busy == fleet[0].name and first == fleet[1].name
    assert {worker for worker, _ in answers} == {"0", "1"}
    assert {pod for _, pod in answers} == {first}


def test_events_posted_to_one_worker_reach_every_worker_or_none(fleet):
    pods = [(p.name, _spec(p, events=False)) for p in fleet]  # no ZMQ: HTTP events only
    tokens = list(range(1000, 1000 + 3 * BLOCK + 5))
    stored = {"type": "BlockStored", "block_hashes": [21, 22, 23], "parent_block_hash": None,
              "token_ids": tokens[: 3 * BLOCK], "block_size": BLOCK, "lora_id": None,
              "medium": "GPU", "lora_name": None}  # fmt: skip
    ring = 64 * 1024
    env = _env(KVGATE_SCALE_OUT__WORKER_BUS_BYTES=str(ring))

    def post(event: dict) -> httpx.Response:
        return httpx.post(f"{gw.admin}/admin/kv-events?pod={fleet[1].name}",
                          content=json.dumps([time.time(), [event], None]),
                          headers={"content-type": "application/json"})  # fmt: skip

    def placements() -> set[tuple[str, str, int]]:
        answers = set()
        for _ in range(16):  # new connections: the kernel spreads them over both workers
            with httpx.Client(timeout=30) as client:
                body = {"model": MODEL, "prompt": tokens, "max_tokens": 1}
                r = client.post(f"{gw}/v1/completions", json=body)
            answers.add((r.headers["x-kvgate-worker"], *_routed(r)))
        return answers

    with run_gateway(pods, strategy="kv-aware", env=env, workers=2) as gw:
        # Over half a ring: the bus cannot carry it, so no worker applies it
        too_big = post({**stored, "padding": "x" * ring})  # unknown fields are ignored
        assert too_big.status_code == 503 and too_big.headers["retry-after"] == "1"
        assert "nothing was applied" in too_big.json()["error"]["message"]
        held: dict[str, dict] = {}  # per worker, what its index holds of the prompt
        for _ in range(40):  # new connections to the shared admin socket reach both
            lookup = httpx.post(f"{gw.admin}/admin/index/lookup",
                                json={"model": MODEL, "prompt": tokens})  # fmt: skip
            held[lookup.headers["x-kvgate-worker"]] = lookup.json()["pods"]
        assert held == {"0": {}, "1": {}}

        assert post(stored).status_code == 200
        answers = placements()

    assert answers == {("0", fleet[1].name, 3 * BLOCK), ("1", fleet[1].name, 3 * BLOCK)}


def test_a_pod_a_reload_removes_leaves_no_series_in_two_workers_metrics(
    fleet, system_prompt, tmp_path
):
    """With --workers the metrics live in files where a label set cannot be removed:
    /metrics shows only the series of the pods (and models) the fleet has now."""
    config = tmp_path / "kvgate.yaml"

    def write(pods) -> None:  # JSON is YAML
        config.write_text(json.dumps({"pods": [{"name": p.name, "url": p.url} for p in pods]}))

    gone = f'pod="{fleet[1].name}"'
    write(fleet)
    with run_gateway([], strategy=None, extra_args=["--config", str(config)], env=_env(),
                     workers=2) as gw:  # fmt: skip
        for i in range(8):  # round-robin in each worker: both pods served
            _chat(gw, system_prompt, f"question {i}", stream=True)  # a TTFT to calibrate on
        assert gone in httpx.get(f"{gw}/metrics").text
        write(fleet[:1])
        assert httpx.post(f"{gw.admin}/admin/reload").status_code == 200
        wait_for(lambda: all(gone not in httpx.get(f"{gw}/metrics").text for _ in range(4)),
                 10, what="the removed pod's series to leave /metrics")  # fmt: skip
        assert f'pod="{fleet[0].name}"' in httpx.get(f"{gw}/metrics").text


def test_two_workers_metrics_are_one_series_per_label_set_never_one_per_worker(
    fleet, system_prompt
):
    """A gauge without a multiprocess mode is exported once per worker, with a ``pid``
    label (the admission queue's was): every kvgate series combines the workers."""
    env = _env(KVGATE_ADMISSION__ENABLED="true")
    with run_gateway([(p.name, _spec(p)) for p in fleet], strategy="kv-aware", env=env,
                     workers=2) as gw:  # fmt: skip
        served = {_chat(gw, system_prompt, f"q{i}").headers["x-kvgate-worker"] for i in range(16)}
        metrics = httpx.get(f"{gw}/metrics").text
    assert served == {"0", "1"}
    assert "kvgate_admission_queue_length{" in metrics
    per_worker = [line for line in metrics.splitlines()
                  if line.startswith("kvgate_") and 'pid="' in line]  # fmt: skip
    assert per_worker == []


def _children(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(c) for c in text.split()}


def _until_both_workers_serve(gw) -> None:
    """``/ready`` answers once one worker listens; the other may be starting still, and
    killing the only listener then leaves the port refusing connections until the
    supervisor's new worker is up."""
    served: set[str] = set()

    def fresh_connection() -> bool:
        with httpx.Client(timeout=5) as client:
            served.add(client.get(f"{gw}/health").headers["x-kvgate-worker"])
        return served == {"0", "1"}

    wait_for(fresh_connection, 20, what="both workers to take connections")


def test_a_worker_that_dies_is_replaced_and_the_port_keeps_serving(fleet, system_prompt):
    with run_gateway([(p.name, _spec(p)) for p in fleet], strategy="kv-aware", env=_env(),
                     workers=2) as gw:  # fmt: skip
        workers = _children(gw.pid)
        assert len(workers) == 2
        _until_both_workers_serve(gw)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)

        _chat(gw, system_prompt, "while one worker is gone")  # the other takes the port
        replaced = wait_for(lambda: len(c := _children(gw.pid)) == 2 and victim not in c and c,
                            20, what="the supervisor to start a new worker")  # fmt: skip
        wait_for(lambda: httpx.get(f"{gw}/ready", timeout=2).status_code == 200, 20,
                 what="the gateway to be ready")  # fmt: skip
        # The new worker takes connections once its app has started (until then the
        # survivor answers /ready for the port): each worker serves a chat in the end.
        served: set[str] = set()
        wait_for(lambda: served.add(_chat(gw, system_prompt, "after").headers["x-kvgate-worker"])
                 or served == {"0", "1"}, 20, what="both workers to serve chats")  # fmt: skip
        # Every request has finished: the pods' in-flight counts return to zero, the
        # dead worker's included. (A worker writes its values for /metrics every 0.1 s
        # and ends a request's count after its last byte, so a scrape right after the
        # client's last chat may still read that chat's 1.)
        wait_for(lambda: (c := scraped(gw, "kvgate_pod_in_flight_requests")) and not any(c),
                 5, what="the pods' in-flight counts to return to zero")  # fmt: skip

    assert len(replaced) == 2 and served == {"0", "1"}


def test_a_restarting_worker_takes_no_connections_until_it_can_serve_them(fleet):
    """A worker joins the port's SO_REUSEPORT group only once its app has started:
    listening earlier, the kernel handed it a share of new connections that waited
    out its startup (a readiness probe with a 2 s timeout once timed out there)."""
    with run_gateway([(p.name, _spec(p)) for p in fleet], strategy="kv-aware", env=_env(),
                     workers=2) as gw:  # fmt: skip
        _until_both_workers_serve(gw)
        victim = min(_children(gw.pid))
        os.kill(victim, signal.SIGKILL)
        seconds, served_by = [], set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            children = _children(gw.pid)
            started = time.monotonic()
            with httpx.Client(timeout=10) as client:  # a new connection each time
                r = client.get(f"{gw}/health")
            seconds.append(time.monotonic() - started)
            served_by.add(r.headers["x-kvgate-worker"])
            if len(children) == 2 and victim not in children and served_by == {"0", "1"}:
                break
    assert served_by == {"0", "1"}  # the new worker did take connections in the end
    assert len(seconds) > 3
    assert max(seconds) < 1.0, sorted(seconds)[-5:]


# -- replicas sharing load through Redis --------------------------------------------------


def _b_routes_while_a_holds_sim_0(
    redis_url: str, wait_s: float, **settings: str
) -> tuple[str, str]:
    """Least-loaded on two replicas whose scraped engine gauges are stale (no probe
    after start): replica A streams from sim-0 (ties go to it); ``wait_s`` later
    replica B routes a request. The pod B chose, and sim-1's name after it."""
    env = _env(KVGATE_INDEX__BACKEND="redis", KVGATE_INDEX__REDIS_URL=redis_url,
               KVGATE_HEALTH__INTERVAL_S="600", **settings)  # fmt: skip
    with sim_fleet(2, block_size=BLOCK, itl_s=0.05, default_max_tokens=60) as pods:
        specs = [(p.name, p.url) for p in pods]
        with (
            run_gateway(specs, strategy="least-loaded", env=env) as a,
            run_gateway(specs, strategy="least-loaded", env=env) as b,
            httpx.Client(timeout=30) as client,
        ):
            body = {"model": MODEL, "prompt": "hello", "stream": True}
            with client.stream("POST", f"{a}/v1/completions", json=body) as held:
                assert held.headers["x-kvgate-pod"] == pods[0].name
                time.sleep(wait_s)
                r = client.post(f"{b}/v1/completions", json={**body, "stream": False,
                                                               "max_tokens": 1})  # fmt: skip
                held.read()
    return r.headers["x-kvgate-pod"], pods[1].name


@pytest.mark.redis
@pytest.mark.parametrize("share", [True, False], ids=["shared-load", "unshared"])
def test_a_replica_sees_the_pods_another_replica_keeps_busy(private_redis: RedisServer, share):
    """Only the shared counts tell replica B that A keeps sim-0 busy."""
    chosen, other = _b_routes_while_a_holds_sim_0(
        private_redis.url, 0.3, KVGATE_SCALE_OUT__SHARE_LOAD=str(share).lower()
    )
    assert (chosen == other) == share


@pytest.mark.redis
def test_a_request_reads_the_other_replicas_counts_when_it_routes(private_redis: RedisServer):
    """As above, but replica B's clock-driven exchanges are 30 s apart (a 120 s
    lease): what tells B, 50 ms after A dispatched, that A keeps sim-0 busy is the
    exchange B's own request makes beside its index lookup."""
    chosen, other = _b_routes_while_a_holds_sim_0(
        private_redis.url, 0.05, KVGATE_SCALE_OUT__LOAD_LEASE_S="120"
    )
    assert chosen == other


@pytest.mark.redis
@pytest.mark.parametrize("share", [True, False], ids=["pooled", "own"])
def test_a_replicas_calibration_points_reach_redis_for_the_others(
    private_redis: RedisServer, fleet, system_prompt, share
):
    """kv-aware on a Redis index: each observed TTFT becomes a point in the model's
    shared list (``gateway.fleet_calibration``), which the other replicas fit from;
    with ``share_calibration`` off, none leaves the replica."""
    env = _env(KVGATE_INDEX__BACKEND="redis", KVGATE_INDEX__REDIS_URL=private_redis.url,
               KVGATE_SCALE_OUT__SHARE_CALIBRATION=str(share).lower(),
               KVGATE_SCALE_OUT__CALIBRATION_INTERVAL_S="0.1")  # fmt: skip
    key = f"{{kvgate:kvgate}}:cal:{MODEL}"
    redis = Redis.from_url(private_redis.url)
    with run_gateway([(p.name, _spec(p)) for p in fleet], strategy="kv-aware", env=env) as gw:
        for i in range(5):
            _chat(gw, system_prompt, f"question {i}", stream=True)  # a TTFT to calibrate on
        if share:
            wait_for(lambda: redis.llen(key) == 5, 5.0, "five points pooled")
        else:
            time.sleep(0.5)  # five rounds of a pooling that is off
    points = redis.lrange(key, 0, -1)
    assert len(points) == (5 if share else 0)
    assert all(decode_point(p) is not None for p in points)


# -- warm start ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_replica_restarted_under_load_routes_cache_hits_within_2s_of_ready(backend, request):
    """Four pods; prompts cached on them; the gateway restarts while one pod is kept
    busy (its events flow) and the others sit idle (theirs do not). Right after the new
    process says ready, every cached prompt goes to the pod holding it, as a hit."""
    env = _env()
    if backend == "redis":
        redis: RedisServer = request.getfixturevalue("private_redis")
        env |= {"KVGATE_INDEX__BACKEND": "redis", "KVGATE_INDEX__REDIS_URL": redis.url}
    tok = ensure_tokenizer()
    prompts = [text_of_tokens(600, seed=100 + i, tokenizer_dir=tok) for i in range(6)]
    with sim_fleet(4, kv_events=True, block_size=BLOCK, itl_s=0.001, default_max_tokens=2,
                   l0_capacity_blocks=4096) as pods:  # fmt: skip
        specs = [(p.name, _spec(p)) for p in pods]
        port = free_port()
        holders = [pods[i % len(pods)].name for i in range(len(prompts))]
        with run_gateway(specs, strategy="kv-aware", env=env, port=port) as gw:
            for i, prompt in enumerate(prompts):  # cached where we put them: every pod
                _chat(pods[i % len(pods)].url, prompt, "seed")
            wait_for(lambda: [_lookup(gw, p) for p in prompts] == holders, 10,
                     what="every prompt's events in the index")  # fmt: skip

        stop = threading.Event()

        def keep_busy() -> None:  # the load: new prompts straight to one pod, 20/s (its
            n = 0  # events flow; its queue stays short, so routing has no reason to spill)
            with httpx.Client(timeout=30) as client:
                while not stop.wait(0.05):
                    n += 1
                    client.post(f"{pods[0].url}/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"busy {n} " * 40}]})  # fmt: skip

        busy = threading.Thread(target=keep_busy, daemon=True)
        busy.start()
        try:
            with run_gateway(specs, strategy="kv-aware", env=env, port=port) as gw:
                ready_at = time.monotonic()
                state = httpx.get(f"{gw}/ready").json()["index"]

                def after_restart(prompt: str) -> tuple[float, tuple[str, int]]:
                    return time.monotonic() - ready_at, _routed(_chat(gw, prompt, "again"))

                with ThreadPoolExecutor(len(prompts)) as pool:  # all sent at once
                    sent = list(pool.map(after_restart, prompts))
        finally:
            stop.set()
            busy.join(10)

    assert state == ("warm" if backend == "memory" else "shared")
    assert max(at for at, _ in sent) < 2.0  # every request left within 2 s of ready
    routed = [r for _, r in sent]
    assert [pod for pod, _ in routed] == holders
    assert all(cached >= 512 for _, cached in routed)
