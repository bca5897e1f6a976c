"""Kubernetes pod discovery end to end, against a recorded API conversation.

No Kubernetes API server can run on these machines (no kind/k3s/kube-apiserver in
the reachable registries), so ``tests/data/k8s/conversation.jsonl`` holds a
kube-apiserver conversation written from the API reference: list responses and
watch stream lines in the real wire format, a watch that times out, a ``410 Gone``,
a ``503``. A loopback aiohttp server plays it, step by step, to the real
``kubernetes_asyncio`` client inside a real ``kvgate serve`` subprocess that finds
it through a kubeconfig. The pods' IPs and ports are rewritten to two simulated vLLM
pods on 127.0.0.1, which then serve the traffic the openai client drives throughout.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from bench.gateway_proc import free_port, run_gateway
from bench.polling import wait_for
from bench.sim.launch import SimPod, sim_fleet

CONVERSATION = Path(__file__).parents[1] / "data" / "k8s" / "conversation.jsonl"
NAMESPACE = "inference"
SELECTOR = "kvgate.io/pool=default"
TOKEN = "replay-token"
POD_A, POD_B = "vllm-5f7c9d8b6-2xkqp", "vllm-5f7c9d8b6-h7m4t"
MODEL = "kvgate-tiny-llama"


def localize(obj: Any, sims: dict[str, SimPod]) -> Any:
    """Point a recorded pod object (or list/event holding pods) at a simulated pod."""
    if isinstance(obj, list):
        return [localize(o, sims) for o in obj]
    if not isinstance(obj, dict):
        return obj
    sim = sims.get((obj.get("metadata") or {}).get("name", ""))
    if sim is None or "spec" not in obj:
        return {k: localize(v, sims) for k, v in obj.items()}
    pod = json.loads(json.dumps(obj))
    if pod["status"].get("podIP"):
        pod["status"]["podIP"] = "127.0.0.1"
        pod["status"]["podIPs"] = [{"ip": "127.0.0.1"}]
    for port in pod["spec"]["containers"][0]["ports"]:
        if port["name"] == "http":
            port["containerPort"] = sim.port
    annotations = pod["metadata"]["annotations"]
    annotations["kvgate.io/kv-events-port"] = sim.events_endpoint.rsplit(":", 1)[1]
    annotations["kvgate.io/kv-replay-port"] = sim.replay_endpoint.rsplit(":", 1)[1]
    return pod


class ReplayApiServer:
    """Plays the recorded conversation to the pods API, pausing where the script says.

    Requests must arrive in the recorded order with the recorded parameters; any
    difference is collected in ``mismatches`` (and answered 400) for the test to see.
    """

    def __init__(self, steps: list[dict[str, Any]], rewrite: Callable[[Any], Any]) -> None:
        self._steps = steps
        self._rewrite = rewrite
        self.mismatches: list[str] = []
        self.paused: str | None = None
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._resume = asyncio.Event()
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> ReplayApiServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._steps.clear()
        self._loop.call_soon_threadsafe(self._resume.set)
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(
            self._runner,
            "127.0.0.1",
            self.port,
        ).start()

    def wait_paused(self, label: str, timeout: float = 15.0) -> None:
        try:
            wait_for(lambda: self.paused == label, timeout, what=f"a pause at {label!r}", poll=0.02)
        except TimeoutError as exc:
            raise AssertionError(f"{exc} ({self.mismatches})") from None

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._resume.set)

    def _check(self, expect: dict[str, str], request: web.Request) -> str | None:
        q = request.query
        got = {
            "verb": "watch" if q.get("watch", "").lower() in ("true", "1") else "list",
            "resourceVersion": q.get("resourceVersion", ""),
            "namespace": request.match_info["namespace"],
            "labelSelector": q.get("labelSelector", ""),
            "auth": request.headers.get("Authorization", ""),
        }
        want = {"resourceVersion": "", "namespace": NAMESPACE, "labelSelector": SELECTOR}
        want |= {"auth": f"Bearer {TOKEN}", **expect}
        return None if got == want else f"expected {want}, got {got}"

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        async with self._lock:  # exchanges happen one at a time, in the recorded order
            step = self._steps.pop(0) if self._steps else {"expect": {"verb": "end"}}
            problem = self._check(step.get("expect", {}), request)
            if problem is not None:
                self.mismatches.append(problem)
                return web.json_response({"kind": "Status", "code": 400}, status=400)
            if "body" in step:
                return web.json_response(self._rewrite(step["body"]), status=step["status"])
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            while self._steps and "expect" not in self._steps[0]:
                step = self._steps.pop(0)
                if "send" in step:
                    line = json.dumps(self._rewrite(step["send"]), separators=(",", ":"))
                    await resp.write(line.encode() + b"\n")
                elif "pause" in step:
                    self.paused = step["pause"]
                    await self._resume.wait()
                    self._resume.clear()
                    self.paused = None
                elif "close" in step:
                    break
            return resp


class Traffic(threading.Thread):
    """Chat completions back to back through the gateway; records (start, pod, error)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self._client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-x", max_retries=0)
        self.records: list[tuple[float, str | None, str | None]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        messages = [{"role": "user", "content": "Which pod answers this?"}]
        while not self._halt.is_set():
            start = time.monotonic()
            try:
                raw = self._client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=4
                )
                raw.parse()
                self.records.append((start, raw.headers.get("x-kvgate-pod"), None))
            except Exception as exc:  # every failure is a test failure, reported below
                self.records.append((start, None, repr(exc)))

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def pods_since(self, t: float) -> set[str | None]:
        return {pod for start, pod, _ in list(self.records) if start >= t}

    def wait_for_pod(self, pod: str, timeout: float = 15.0) -> None:
        wait_for(lambda: pod in self.pods_since(0), timeout, what=f"traffic to {pod}")


def healthy_pods(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {
        m[0]: float(m[1])
        for m in re.findall(r'^kvgate_pod_healthy\{pod="([^"]+)"\} (\S+)$', text, re.M)
    }


def metric(base: str, name: str, labels: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    found = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def subscribers(base: str) -> set[str]:
    return set(httpx.get(f"{base.admin}/admin/index/stats").json()["subscribers"])


@pytest.fixture()
def sims():
    with sim_fleet(2, kv_events=True, itl_s=0.002, overhead_s=0.002) as pods:
        yield {POD_A: pods[0], POD_B: pods[1]}


def kubeconfig(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "replay", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "gw", "user": {"token": TOKEN}}],
                "contexts": [{"name": "replay", "context": {"cluster": "replay", "user": "gw"}}],
                "current-context": "replay",
            }
        )
    )
    return path


def test_pod_joins_when_ready_serves_and_leaves_when_deleted_without_failed_requests(
    sims, tmp_path
):
    steps = [json.loads(line) for line in CONVERSATION.read_text().splitlines()]
    with ReplayApiServer(steps, lambda obj: localize(obj, sims)) as api:
        env = {
            "KVGATE_DISCOVERY__ENABLED": "true",
            "KVGATE_DISCOVERY__KUBECONFIG": str(kubeconfig(tmp_path, api.port)),
            "KVGATE_DISCOVERY__NAMESPACE": NAMESPACE,
            "KVGATE_DISCOVERY__LABEL_SELECTOR": SELECTOR,
            "KVGATE_DISCOVERY__BACKOFF_INITIAL_S": "0.2",
        }
        with run_gateway([], env=env) as gw:  # ready: the listed pod A was found and probed
            traffic = Traffic(gw)
            traffic.start()
            try:
                traffic.wait_for_pod(POD_A)
                # B is scheduled, then Running but not Ready: it gets nothing.
                api.wait_paused("B running, not ready")
                wait_for(
                    lambda: metric(gw, "kvgate_discovery_events_total", 'type="MODIFIED"') == 1,
                    timeout=15.0,
                    what="the gateway applied B's update",
                )
                assert healthy_pods(gw) == {POD_A: 1.0}
                assert traffic.pods_since(0) == {POD_A}

                # B turns Ready: round-robin sends it traffic, and its KV events are followed.
                api.resume()
                api.wait_paused("B ready")
                traffic.wait_for_pod(POD_B)
                assert healthy_pods(gw) == {POD_A: 1.0, POD_B: 1.0}
                wait_for(
                    lambda: subscribers(gw) == {POD_A, POD_B},
                    timeout=15.0,
                    what="both pods' events followed",
                )

                # Watch times out, resumes, gets 410 Gone, re-lists, a 503, resumes again.
                api.resume()
                api.wait_paused("relisted")
                assert metric(gw, "kvgate_discovery_errors_total", 'cause="gone"') == 1
                assert metric(gw, "kvgate_discovery_errors_total", 'cause="http_5xx"') == 1
                assert healthy_pods(gw) == {POD_A: 1.0, POD_B: 1.0}

                # A is being deleted (Ready still True): it leaves routing at once.
                api.resume()
                api.wait_paused("A terminating")
                wait_for(lambda: POD_A not in healthy_pods(gw), timeout=15.0, what="A left routing")
                left = time.monotonic()
                assert subscribers(gw) == {POD_B}
                time.sleep(0.5)
                assert traffic.pods_since(left) == {POD_B}

                # A is gone from the API; its process stops; traffic carries on.
                api.resume()
                api.wait_paused("A deleted")
                sims[POD_A].stop()
                time.sleep(0.5)
                assert healthy_pods(gw) == {POD_B: 1.0}
                assert traffic.pods_since(left) == {POD_B}
            finally:
                traffic.stop()
        assert api.mismatches == []
    errors = [err for _, _, err in traffic.records if err is not None]
    assert errors == []
    assert len(traffic.records) > 50
