"""Bounds audit: a model no pod serves any more leaves no metric series behind. LoRA
adapters are loaded and unloaded at run time, each a model of its own, so series kept
per model that ever was would grow with every adapter a fleet has ever served. A
request in flight for a model as it leaves is still counted; its series go when it ends.
A model served again later just starts new series."""

from __future__ import annotations

import asyncio

from bench.polling import wait_for_async
from tests.inproc.harness import CHAT, InprocGateway, inproc_gateway
from tests.inproc.scripted_pod import MODEL, ScriptedPod, answer, completion, hang
from tests.openai_errors import assert_openai_error


async def structures(g: InprocGateway) -> dict[str, dict]:
    return (await g.admin.get("/admin/bounds")).json()["structures"]


async def reprobe(g: InprocGateway, pod: ScriptedPod) -> None:
    """The registry re-reads ``pod``'s /v1/models, as its next probe would."""
    await g.gw.registry.probe(g.gw.registry.get(pod.name))


async def test_adapters_loaded_served_and_unloaded_leave_no_series(pod_a):
    # The earlier audit's reproduction: one pod loads, serves and unloads 20 adapters.
    async with inproc_gateway(pod_a, admission={"enabled": True}) as g:
        assert (await g.chat()).status_code == 200
        for i in range(20):
            pod_a.load_adapter(f"lora-{i}")
            await reprobe(g, pod_a)
            assert (await g.chat({**CHAT, "model": f"lora-{i}"})).status_code == 200
            assert g.series(model=f"lora-{i}") != []  # requests, latency, admission ...
            pod_a.unload_adapter(f"lora-{i}")
            await reprobe(g, pod_a)
        assert g.gw.registry.known_models() == {MODEL}
        assert g.label_values("model") == {MODEL}
        # The base model's series stay, and so does what admission control keeps of it.
        assert g.metric("kvgate_requests_total", model=MODEL, status="200") == 1
        assert g.metric("kvgate_admission_wait_seconds_count", model=MODEL) == 1
        admission = [k.split(".")[1] for k in await structures(g) if k.startswith("admission.")]
        assert set(admission) == {MODEL}


async def test_an_adapter_served_again_starts_new_series(pod_a):
    adapter = {**CHAT, "model": "sql-lora"}
    async with inproc_gateway(pod_a) as g:
        pod_a.load_adapter("sql-lora")
        await reprobe(g, pod_a)
        assert (await g.chat(adapter)).status_code == 200
        pod_a.unload_adapter("sql-lora")
        await reprobe(g, pod_a)
        assert g.series(model="sql-lora") == []
        pod_a.load_adapter("sql-lora")
        await reprobe(g, pod_a)
        assert (await g.chat(adapter)).status_code == 200
        assert g.metric("kvgate_requests_total", model="sql-lora") == 1


async def test_an_adapter_another_pod_still_serves_keeps_its_series(pod_a, pod_b):
    adapter = {**CHAT, "model": "sql-lora"}
    pod_a.load_adapter("sql-lora")
    pod_b.load_adapter("sql-lora")
    async with inproc_gateway(pod_a, pod_b) as g:
        assert [(await g.chat(adapter)).status_code for _ in range(2)] == [200, 200]
        pod_a.unload_adapter("sql-lora")
        await reprobe(g, pod_a)
        assert g.metric("kvgate_requests_total", model="sql-lora") == 2
        await g.gw.registry.remove("pod-b")  # the last pod serving it leaves the fleet
        assert g.series(model="sql-lora") == []
        assert g.metric("kvgate_requests_total", model=MODEL) == 0  # none sent: none kept
        assert (await g.chat()).status_code == 200
        assert g.label_values("model") == {MODEL}


async def test_a_request_in_flight_as_its_adapter_is_unloaded_is_counted_then_its_series_go(
    pod_a,
):
    release = asyncio.Event()
    pod_a.load_adapter("sql-lora")
    pod_a.script(hang(release, answer(completion())))
    async with inproc_gateway(pod_a) as g:
        request = asyncio.create_task(g.chat({**CHAT, "model": "sql-lora"}))
        await wait_for_async(lambda: bool(pod_a.received), 2.0, "the request at pod-a")
        pod_a.unload_adapter("sql-lora")
        await reprobe(g, pod_a)
        assert "sql-lora" not in g.gw.registry.known_models()
        # What the request's end writes is there when its load is released, then goes.
        metrics = g.gw.metrics
        counted: list[float] = []
        released = metrics.released

        def counting_released(*args: str) -> None:
            counted.append(g.metric("kvgate_requests_total", model="sql-lora", status="200"))
            released(*args)

        metrics.released = counting_released  # type: ignore[method-assign]
        release.set()
        assert (await request).status_code == 200
        assert counted == [1]
        assert g.series(model="sql-lora") == []
        assert (await g.chat()).status_code == 200  # the base model's series are untouched
        assert g.metric("kvgate_requests_total", model=MODEL, pod="pod-a") == 1


async def test_a_waiting_request_keeps_its_models_admission_state_until_it_is_shed(pod_a):
    """Admission control keeps a leaving model's queue while requests wait in it; the
    429 of one that resolved its model before it left is written after it left, and goes
    at the next change of the fleet's models."""
    release = asyncio.Event()
    pod_a.load_adapter("sql-lora")
    pod_a.load_adapter("other-lora")
    pod_a.script(hang(release, answer(completion())))
    adapter = {**CHAT, "model": "sql-lora"}
    admission = {"enabled": True, "max_in_flight_per_pod": 1, "max_wait_s": 0.3}
    async with inproc_gateway(pod_a, admission=admission) as g:
        first = asyncio.create_task(g.chat(adapter))
        await wait_for_async(lambda: bool(pod_a.received), 2.0, "the first request held")
        waiting = asyncio.create_task(g.chat(adapter))
        await wait_for_async(lambda: g.metric("kvgate_admission_queue_length") == 1, 2.0,
                             "a request waiting", poll=0.002)  # fmt: skip
        pod_a.unload_adapter("sql-lora")
        await reprobe(g, pod_a)
        assert g.metric("kvgate_admission_queue_length", model="sql-lora") == 1  # kept
        assert "admission.sql-lora.waiting" in await structures(g)
        release.set()
        assert (await first).status_code == 200
        assert_openai_error(await waiting, 429)  # no pod serves it now: it waited its time
        assert "admission.sql-lora.waiting" not in await structures(g)
        # Only its 429, counted after the model left (pod="": never routed) is left ...
        assert g.metric("kvgate_requests_total", model="sql-lora", pod="", status="429") == 1
        assert all(s.startswith("kvgate_requests_") for s in g.series(model="sql-lora"))
        pod_a.unload_adapter("other-lora")  # ... until the fleet's models change again
        await reprobe(g, pod_a)
        assert g.series(model="sql-lora") == []


async def test_a_tokenize_failure_series_goes_with_its_adapter(pod_a):
    pod_a.load_adapter("sql-lora")
    pod_a.script(answer({"error": "no tokenizer"}, 500))  # the engine's /tokenize
    async with inproc_gateway(pod_a, strategy="kv-aware") as g:
        r = await g.client.post(
            "/v1/completions", json={"model": "sql-lora", "prompt": "hello " * 64}
        )
        assert r.status_code == 200, r.text
        assert g.metric("kvgate_tokenize_failures_total", model="sql-lora") == 1
        pod_a.unload_adapter("sql-lora")
        await reprobe(g, pod_a)
        assert g.series(model="sql-lora") == []
