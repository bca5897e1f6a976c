"""Admission control at the gateway: requests wait for a pod with room in priority order,
fairly across tenants, and are shed with 429 and Retry-After when they cannot be served
in time; a waiting client that leaves gives up its place."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import openai
import pytest

from bench.polling import wait_for_async
from gateway.app import create_app
from gateway.config import Settings
from tests.inproc.harness import ANTHROPIC, InprocGateway, inproc_gateway
from tests.inproc.scripted_pod import (
    MODEL,
    ScriptedPod,
    answer,
    completion,
    delta,
    hang,
    sse,
    stream,
)
from tests.openai_errors import assert_anthropic_error, assert_openai_error
from tests.readme_metrics import readme_metric_names

ONE_AT_A_TIME = {"enabled": True, "max_in_flight_per_pod": 1}


def chat_body(content: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def contents(pod: ScriptedPod) -> list[str]:
    """The user message of each request the pod received, in arrival order."""
    return [json.loads(r.body)["messages"][0]["content"] for r in pod.received]


async def queued(g: InprocGateway, n: int) -> None:
    await wait_for_async(
        lambda: g.metric("kvgate_admission_queue_length") == n, 2.0, f"{n} queued", poll=0.002
    )


async def hold_the_pod(g: InprocGateway, pod: ScriptedPod) -> tuple[asyncio.Event, asyncio.Task]:
    """A first request the pod holds until the returned event is set."""
    release = asyncio.Event()
    pod.script(hang(until=release, then=answer(completion())))
    first = asyncio.create_task(g.chat(chat_body("first")))
    await wait_for_async(lambda: len(pod.received) == 1, 2.0, "the first request held")
    return release, first


async def test_waiting_requests_reach_the_pod_in_priority_order(pod_a):
    async with inproc_gateway(pod_a, admission=ONE_AT_A_TIME) as g:
        release, first = await hold_the_pod(g, pod_a)
        calls = []
        for name, priority in [("low-1", "low"), ("normal-1", "normal"), ("low-2", "low"),
                               ("high-1", "high")]:  # fmt: skip
            headers = {"x-kvgate-priority": priority}
            calls.append(asyncio.create_task(g.chat(chat_body(name), headers=headers)))
            await queued(g, len(calls))
        assert g.metric("kvgate_admission_queue_length", priority="low") == 2
        release.set()
        responses = await asyncio.gather(first, *calls)
        assert [r.status_code for r in responses] == [200] * 5
        assert contents(pod_a) == ["first", "high-1", "normal-1", "low-1", "low-2"]
        assert g.metric("kvgate_admission_queue_length") == 0
        assert g.metric("kvgate_admission_wait_seconds_count", priority="low") == 2
        assert g.metric("kvgate_admission_wait_seconds_count", priority="normal") == 2


async def test_a_prefilling_limit_lets_the_next_request_go_at_the_first_token(pod_a):
    release = asyncio.Event()
    pod_a.script(hang(until=release, then=stream([sse(delta("Hel"))], ending="hold")))
    async with inproc_gateway(pod_a, admission={"enabled": True, "max_prefilling_per_pod": 1}) as g:
        first = g.stream_chat()
        await wait_for_async(lambda: len(pod_a.received) == 1, 2.0, "the first request held")
        second = asyncio.create_task(g.chat(chat_body("second")))
        await queued(g, 1)  # the pod is still prefilling the first
        release.set()  # its first token: the second may go, the first still streams
        assert (await second).status_code == 200
        assert len(pod_a.received) == 2 and not first.complete
        first.leave()
        await first.finished()


async def test_a_full_queue_is_429_with_retry_after_in_openai_shape_for_the_openai_client(pod_a):
    admission = {**ONE_AT_A_TIME, "max_queue": 1}
    async with inproc_gateway(pod_a, admission=admission) as g:
        release, first = await hold_the_pod(g, pod_a)
        waiting = asyncio.create_task(g.chat(chat_body("waiting")))
        await queued(g, 1)
        transport = httpx.ASGITransport(app=g.app)
        async with httpx.AsyncClient(transport=transport) as http:
            client = openai.AsyncOpenAI(base_url="http://kvgate/v1", api_key="x",
                                        http_client=http, max_retries=0)  # fmt: skip
            with pytest.raises(openai.RateLimitError) as caught:
                await client.chat.completions.create(model=MODEL, messages=[
                    {"role": "user", "content": "one too many"}])  # fmt: skip
        response = caught.value.response
        err = assert_openai_error(response, 429)
        assert (err["type"], err["code"]) == ("rate_limit_error", "queue_full")
        assert 1 <= int(response.headers["retry-after"]) <= 60
        assert response.headers["x-request-id"]
        assert g.metric("kvgate_admission_shed_total", reason="queue_full") == 1
        assert g.metric("kvgate_requests_total", status="429") == 1
        release.set()
        assert [r.status_code for r in await asyncio.gather(first, waiting)] == [200, 200]
        assert contents(pod_a) == ["first", "waiting"]


async def test_a_shed_messages_request_is_429_in_anthropics_shape(pod_a):
    async with inproc_gateway(pod_a, admission={**ONE_AT_A_TIME, "max_queue": 0}) as g:
        release, first = await hold_the_pod(g, pod_a)
        shed = await g.client.post("/v1/messages", json=ANTHROPIC)
        assert assert_anthropic_error(shed, 429)["type"] == "rate_limit_error"
        assert int(shed.headers["retry-after"]) >= 1
        release.set()
        assert (await first).status_code == 200


async def test_kv_aware_sheds_a_request_whose_predicted_ttft_exceeds_its_slo_header(pod_a):
    # 3,000 prompt tokens on the default cost model: ~90 ms overhead + 3000 / 3653 s.
    body = {"model": MODEL, "prompt": list(range(3000)), "max_tokens": 1}
    admission = {"enabled": True}
    async with inproc_gateway(pod_a, strategy="kv-aware", admission=admission,
                              expose_predictions=True) as g:  # fmt: skip
        shed = await g.client.post("/v1/completions", json=body,
                                   headers={"x-kvgate-ttft-slo-ms": "500"})  # fmt: skip
        err = assert_openai_error(shed, 429)
        assert err["code"] == "slo" and "predicted time to first token (911 ms)" in err["message"]
        assert shed.headers["retry-after"] == "1"
        served = await g.client.post("/v1/completions", json=body,
                                     headers={"x-kvgate-ttft-slo-ms": "2000"})  # fmt: skip
        assert served.status_code == 200
        assert len(pod_a.received) == 1
        assert g.metric("kvgate_admission_shed_total", reason="slo", priority="normal") == 1


async def test_an_slo_shed_tells_a_caller_without_predictions_nothing_of_the_cache(pod_a):
    # The predicted TTFT says how much of a prompt is cached; with expose_predictions off
    # (the default) the x-kvgate-predicted-* headers are hidden, and so is it here.
    # 10,000 tokens: ~90 ms + 10000 / 3653 s = 2.83 s predicted, 2.83 s over a 1 ms SLO.
    body = {"model": MODEL, "prompt": list(range(10_000)), "max_tokens": 1}
    slo = {"x-kvgate-ttft-slo-ms": "1"}
    admission = {"enabled": True}
    async with inproc_gateway(pod_a, strategy="kv-aware", admission=admission,
                              admin={"api_keys": ["admin-key"]}) as g:  # fmt: skip
        plain = await g.client.post("/v1/completions", json=body, headers=slo)
        err = assert_openai_error(plain, 429)
        assert err["code"] == "slo"
        assert err["message"] == "the predicted time to first token exceeds the request's SLO"
        assert plain.headers["retry-after"] == "1"  # not the predicted overshoot
        admin = await g.client.post("/v1/completions", json=body,
                                    headers={**slo, "x-kvgate-admin-key": "admin-key"})  # fmt: skip
        assert (
            "predicted time to first token (2827 ms)" in assert_openai_error(admin, 429)["message"]
        )
        assert admin.headers["retry-after"] == "3"
    assert pod_a.received == []


async def test_a_tenant_is_the_same_whichever_header_carries_its_key(pod_a):
    keys = {"authorization": "Bearer key-batch", "x-api-key": "key-batch"}
    batch = {"name": "batch", "api_keys": ["key-batch"], "priority": "low", "weight": 0.1}
    admission = {**ONE_AT_A_TIME, "tenants": [batch]}
    async with inproc_gateway(pod_a, admission=admission, api_keys=["key-batch"]) as g:
        for name, value in keys.items():
            # the header asks for more than the tenant may have: its ceiling holds
            ticket = g.gw.admission.ticket({name: value, "x-kvgate-priority": "high"}, 0.0)
            assert (ticket.tenant, ticket.priority, ticket.weight) == ("batch", 2, 0.1), name


async def test_a_per_model_slo_applies_when_the_request_names_none(pod_a):
    body = {"model": MODEL, "prompt": list(range(3000)), "max_tokens": 1}
    models = {MODEL: {"ttft_slo_ms": 100}}
    async with inproc_gateway(pod_a, strategy="kv-aware", admission={"enabled": True},
                              models=models) as g:  # fmt: skip
        r = await g.client.post("/v1/completions", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (429, "slo")  # shed by the SLO
        assert pod_a.received == []


async def test_a_flooding_tenant_does_not_starve_another(pod_a):
    keys = {"flood": "key-flood", "calm": "key-calm"}
    async with inproc_gateway(pod_a, admission=ONE_AT_A_TIME, api_keys=list(keys.values())) as g:
        auth = {name: {"authorization": f"Bearer {key}"} for name, key in keys.items()}
        release = asyncio.Event()
        pod_a.script(hang(until=release, then=answer(completion())))
        calls = [asyncio.create_task(g.chat(chat_body("first"), headers=auth["flood"]))]
        await wait_for_async(lambda: len(pod_a.received) == 1, 2.0, "the first request held")
        for i in range(4):
            calls.append(asyncio.create_task(g.chat(chat_body(f"flood-{i}"),
                                                    headers=auth["flood"])))  # fmt: skip
            await queued(g, i + 1)
        for i in range(2):
            calls.append(asyncio.create_task(g.chat(chat_body(f"calm-{i}"),
                                                    headers=auth["calm"])))  # fmt: skip
            await queued(g, 5 + i)
        release.set()
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 7
        assert contents(pod_a) == ["first", "flood-0", "calm-0", "flood-1", "calm-1", "flood-2",
                                   "flood-3"]  # fmt: skip


async def test_a_configured_tenant_gets_its_priority_and_a_header_cannot_raise_it(pod_a):
    admission = {**ONE_AT_A_TIME, "tenant_source": "header",
                 "tenants": [{"name": "batch", "priority": "low"},
                             {"name": "search", "priority": "high"}]}  # fmt: skip
    async with inproc_gateway(pod_a, admission=admission) as g:
        release, first = await hold_the_pod(g, pod_a)
        sent = [("batch-asks-high", {"x-tenant-id": "batch", "x-kvgate-priority": "high"}),
                ("anonymous", {}),
                ("search", {"x-tenant-id": "search"})]  # fmt: skip
        calls = []
        for name, headers in sent:
            calls.append(asyncio.create_task(g.chat(chat_body(name), headers=headers)))
            await queued(g, len(calls))
        release.set()
        await asyncio.gather(first, *calls)
        assert contents(pod_a) == ["first", "search", "anonymous", "batch-asks-high"]


async def test_a_client_that_leaves_while_queued_gives_up_its_place(pod_a):
    async with inproc_gateway(pod_a, admission=ONE_AT_A_TIME) as g:
        release, first = await hold_the_pod(g, pod_a)
        leaving = g.stream_chat()
        await queued(g, 1)
        staying = asyncio.create_task(g.chat(chat_body("staying")))
        await queued(g, 2)
        leaving.leave()
        await leaving.finished()
        assert leaving.status is None  # nothing was sent to a client that left
        assert g.metric("kvgate_admission_queue_length") == 1
        assert g.metric("kvgate_requests_total", status="499") == 1
        release.set()
        assert [r.status_code for r in await asyncio.gather(first, staying)] == [200, 200]
        assert contents(pod_a) == ["first", "staying"]
        assert g.load("pod-a") == 0


async def test_a_request_that_waits_past_max_wait_is_429_queue_timeout(pod_a):
    admission = {**ONE_AT_A_TIME, "max_wait_s": 0.1}
    async with inproc_gateway(pod_a, admission=admission) as g:
        release, first = await hold_the_pod(g, pod_a)
        late = await g.chat(chat_body("late"))
        err = assert_openai_error(late, 429)
        assert err["code"] == "queue_timeout"
        assert int(late.headers["retry-after"]) >= 1
        assert g.metric("kvgate_admission_shed_total", reason="queue_timeout") == 1
        assert g.metric("kvgate_admission_queue_length") == 0
        release.set()
        assert (await first).status_code == 200
        assert contents(pod_a) == ["first"]


async def test_a_bad_priority_or_slo_header_is_400(pod_a):
    async with inproc_gateway(pod_a, admission={"enabled": True}) as g:
        bad_priority = await g.chat(headers={"x-kvgate-priority": "urgent!"})
        assert assert_openai_error(bad_priority, 400)["code"] == "invalid_priority"
        bad_slo = await g.chat(headers={"x-kvgate-ttft-slo-ms": "-5"})
        assert assert_openai_error(bad_slo, 400)["code"] == "invalid_slo"
        assert pod_a.received == []


async def test_admission_is_off_by_default_and_exports_nothing(pod_a):
    async with inproc_gateway(pod_a) as g:
        assert g.gw.admission is None
        assert (await g.chat(headers={"x-kvgate-priority": "anything"})).status_code == 200
        names = {f.name for f in g.gw.prometheus.collect()}
        assert not any(n.startswith("kvgate_admission") for n in names)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
async def test_promtool_accepts_the_admission_metrics_the_readme_lists(pod_a):
    admission = {**ONE_AT_A_TIME, "max_queue": 0}
    async with inproc_gateway(pod_a, admission=admission) as g:
        release, first = await hold_the_pod(g, pod_a)
        assert (await g.chat(chat_body("shed"))).status_code == 429
        text = (await g.client.get("/metrics")).text
        release.set()
        await first
    assert "kvgate_admission_shed_total{" in text and "kvgate_admission_queue_length{" in text
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    documented = {n for n in readme_metric_names() if n.startswith("kvgate_admission_")}
    assert len(documented) == 3
    assert documented <= declared
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


async def test_admin_bounds_lists_each_models_queue_and_fairness_state(pod_a):
    async with inproc_gateway(pod_a, admission={"enabled": True, "max_queue": 50}) as g:
        assert (await g.chat()).status_code == 200
        structures = (await g.admin.get("/admin/bounds")).json()["structures"]
        waiting = structures[f"admission.{MODEL}.waiting"]
        tags = structures[f"admission.{MODEL}.tenant_tags"]
        assert (waiting["size"], waiting["capacity"], waiting["unit"]) == (0, 50, "requests")
        assert (tags["size"], tags["capacity"], tags["unit"]) == (0, 3 * 1024, "tenants")


async def test_header_names_in_the_settings_match_whatever_their_case(pod_a):
    admission = {"enabled": True, "tenant_source": "header", "tenant_header": "X-Tenant-Id",
                 "priority_header": "X-Priority", "slo_header": "X-SLO-ms",
                 "tenants": [{"name": "batch", "priority": "low"}]}  # fmt: skip
    async with inproc_gateway(pod_a, admission=admission) as g:
        # as ASGI hands them over: lowercased
        headers = {"x-tenant-id": "batch", "x-priority": "low", "x-slo-ms": "250"}
        ticket = g.gw.admission.ticket(headers, 0.0)
        assert (ticket.tenant, ticket.priority, ticket.slo_s) == ("batch", 2, 0.25)


def test_a_model_admission_setting_no_policy_takes_fails_at_start_naming_the_model():
    # 5e-324 ms passes the settings' "> 0" but is 0 s, which no policy takes
    settings = Settings(admission={"enabled": True}, models={MODEL: {"ttft_slo_ms": 5e-324}})
    with pytest.raises(ValueError, match=f"models.{MODEL}"):
        create_app(settings)
