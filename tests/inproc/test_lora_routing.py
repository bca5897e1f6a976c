"""LoRA adapters: learnt from each pod's /v1/models (cards with a parent), an adapter's
requests go only to pods serving it, and the gateway re-reads the pods' models when a
request names a model none listed (an adapter loaded since) or a pod answers 404 (one
unloaded); what it keeps per pod is bounded."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.polling import wait_for_async
from gateway.config import PodConfig
from gateway.kv import lora_of
from gateway.pods import Pod
from tests.inproc.harness import ANTHROPIC, CHAT, inproc_gateway
from tests.inproc.scripted_pod import MODEL, answer
from tests.openai_errors import assert_anthropic_error, assert_openai_error

ADAPTER = {**CHAT, "model": "sql-lora"}


async def test_an_adapter_goes_only_to_the_pods_that_serve_it(pod_a, pod_b):
    pod_b.load_adapter("sql-lora")
    async with inproc_gateway(pod_a, pod_b, strategy="round-robin") as g:
        adapter = [(await g.chat(ADAPTER)).headers["x-kvgate-pod"] for _ in range(4)]
        base = [(await g.chat()).headers["x-kvgate-pod"] for _ in range(4)]
    assert adapter == ["pod-b"] * 4
    assert sorted(base) == ["pod-a", "pod-a", "pod-b", "pod-b"]


async def test_an_adapter_no_pod_serves_is_404_in_each_apis_shape(pod_a):
    async with inproc_gateway(pod_a) as g:
        chat = await g.chat(ADAPTER)
        err = assert_openai_error(chat, 404, param="model")
        assert err["code"] == "model_not_found" and MODEL in err["message"]
        messages = await g.client.post("/v1/messages", json={**ANTHROPIC, "model": "sql-lora"})
        assert assert_anthropic_error(messages, 404)["type"] == "not_found_error"
        # only models the registry knows become metric labels
        assert g.metric("kvgate_requests_total", model="sql-lora") == 0
        assert g.metric("kvgate_requests_total", model="", status="404") == 2


async def test_an_adapter_loaded_after_the_last_probe_is_found_by_asking_the_pods(pod_a):
    async with inproc_gateway(pod_a) as g:  # probes once, at start-up
        reads = pod_a.model_reads
        pod_a.load_adapter("sql-lora")
        r = await g.chat(ADAPTER)
        assert r.status_code == 200, r.text
        assert pod_a.model_reads == reads + 1


async def test_unknown_models_reread_the_pods_at_most_once_per_interval(pod_a):
    async with inproc_gateway(pod_a, lora={"refresh_min_interval_s": 60}) as g:
        reads = pod_a.model_reads
        answers = await asyncio.gather(*(g.chat({**CHAT, "model": f"m{i}"}) for i in range(8)))
        assert [r.status_code for r in answers] == [404] * 8
        assert pod_a.model_reads == reads + 1


# vLLM's answer for a model it does not serve (serving.py, _check_model)
GONE = {"error": {"message": "The model `sql-lora` does not exist. Valid aliases: m.",
                  "type": "NotFoundError", "param": "model", "code": 404}}  # fmt: skip


async def test_an_adapter_unloaded_on_one_pod_is_answered_by_another_and_reread(pod_a, pod_b):
    """Between two probes pod-a unloads the adapter pod-b still serves: pod-b answers the
    request (pod-a's 404 would say the model does not exist at all), pod-a is not
    counted as failing, and its models are re-read."""
    for pod in (pod_a, pod_b):
        pod.load_adapter("sql-lora")
    async with inproc_gateway(pod_a, pod_b, strategy="round-robin") as g:
        pod_a.unload_adapter("sql-lora")
        pod_a.script(answer(GONE, 404))
        first = await g.chat(ADAPTER)
        assert first.status_code == 200 and first.headers["x-kvgate-pod"] == "pod-b", first.text
        assert [json.loads(r.body)["model"] for r in pod_a.received] == ["sql-lora"]  # asked
        assert g.failures("pod-a") == 0
        assert g.metric("kvgate_retries_total", model="sql-lora", cause="model_gone") == 1
        await wait_for_async(
            lambda: "sql-lora" not in g.gw.registry.get("pod-a").models, 2.0, "pod-a re-read"
        )
        after = [(await g.chat(ADAPTER)).headers["x-kvgate-pod"] for _ in range(3)]
    assert after == ["pod-b"] * 3


async def test_a_404_that_names_no_model_or_from_the_only_pod_is_passed_on(pod_a, pod_b):
    for pod in (pod_a, pod_b):
        pod.load_adapter("sql-lora")
    async with inproc_gateway(pod_a, pod_b, strategy="round-robin") as g:
        pod_a.script(answer({"error": {"message": "Not Found"}}, 404))
        r = await g.chat(ADAPTER)
        assert r.status_code == 404 and r.headers["x-kvgate-pod"] == "pod-a"  # not about it
    pod_a.load_adapter("sql-lora")
    async with inproc_gateway(pod_a) as g:
        pod_a.unload_adapter("sql-lora")
        pod_a.script(answer(GONE, 404))
        r = await g.chat(ADAPTER)
        assert r.status_code == 404 and r.json() == GONE  # no other pod: the pod's own


async def test_the_models_kept_per_pod_are_bounded(pod_a):
    for i in range(5):
        pod_a.load_adapter(f"lora-{i}")
    async with inproc_gateway(pod_a, lora={"max_models_per_pod": 3}) as g:
        assert g.gw.registry.known_models() == {MODEL, "lora-0", "lora-1"}
        listed = (await g.client.get("/v1/models")).json()["data"]
        assert sorted((c["id"], c["parent"] or "") for c in listed) == [
            ("lora-0", MODEL), ("lora-1", MODEL), (MODEL, ""),
        ]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_adapters_route_on_every_generation_api(pod_a, pod_b, path):
    pod_a.load_adapter("sql-lora")
    body = {"model": "sql-lora", "input": "hi"} if path == "/v1/responses" else {
        **ANTHROPIC, "model": "sql-lora"}  # fmt: skip
    async with inproc_gateway(pod_a, pod_b, strategy="round-robin") as g:
        pods = [(await g.client.post(path, json=body)).headers["x-kvgate-pod"] for _ in range(3)]
    assert pods == ["pod-a"] * 3


async def test_prefix_memory_keeps_an_adapters_prompts_apart_from_the_base_models(pod_a):
    pod_a.load_adapter("sql-lora")
    async with inproc_gateway(pod_a, strategy="prefix-aware") as g:
        for model in (MODEL, "sql-lora", "sql-lora", MODEL):
            assert (await g.chat({**CHAT, "model": model})).status_code == 200
        hits = g.metric("kvgate_routing_decisions_total", reason="cache_hit")
        misses = g.metric("kvgate_routing_decisions_total", reason="least_loaded")
    assert (hits, misses) == (2, 2)  # each model's second request, never the first


def _pod(name: str, cards: dict[str, str | None]) -> Pod:
    """A pod whose /v1/models listed ``cards`` (id: parent)."""
    listed = {m: {"id": m, "parent": parent} for m, parent in cards.items()}
    return Pod(PodConfig(name=name, url=f"http://{name}"), models=set(cards),
               model_cards=listed)  # fmt: skip


def test_one_pods_card_cannot_make_a_base_model_an_adapter_for_the_fleet():
    honest = _pod("a", {"llama": None, "sql-lora": "llama"})
    lying = _pod("b", {"llama": "evil"})  # "llama" as an adapter of a model it lacks
    assert lora_of("llama", [honest, lying]) == ("llama", None)
    assert lora_of("llama", [lying, honest]) == ("llama", None)
    assert lora_of("llama", [lying]) == ("llama", None)  # its parent is not served there
    assert lora_of("sql-lora", [lying, honest]) == ("llama", "sql-lora")
