"""Before the first byte, a failing pod is retried on another one, and held to account.

pod-a fails each request below in its own way; pod-b answers. Round-robin orders
pods by name, so pod-a is tried first.
"""

from __future__ import annotations

import pytest

from tests.inproc.harness import CHAT, STREAM_CHAT, inproc_gateway
from tests.inproc.scripted_pod import MODEL, answer, completion, drop, stream
from tests.openai_errors import assert_openai_error

FROM_B = completion(text="from pod-b")


def served(r) -> tuple:
    """(status, pod that answered, body): what the client got."""
    return r.status_code, r.headers.get("x-kvgate-pod"), r.json()


async def test_connect_error_is_retried_on_the_other_pod(pod_a, pod_b):
    async with inproc_gateway(pod_a, pod_b) as g:
        await pod_a.close()  # admitted at start-up; now its port refuses connections
        assert served(await g.chat()) == (200, "pod-b", FROM_B)
        assert g.metric("kvgate_retries_total", model=MODEL, cause="connect") == 1
        assert g.failures("pod-a") == 1
        assert g.metric("kvgate_requests_total", pod="pod-b", status="200") == 1


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_before_first_byte_is_retried_on_the_other_pod(pod_a, pod_b, status):
    pod_a.script(answer({"error": "engine died"}, status=status))
    async with inproc_gateway(pod_a, pod_b) as g:
        assert served(await g.chat()) == (200, "pod-b", FROM_B)
        assert g.metric("kvgate_retries_total", model=MODEL, cause=f"status_{status}") == 1
        assert g.failures("pod-a") == 1
        assert (len(pod_a.received), len(pod_b.received)) == (1, 1)


@pytest.mark.parametrize(
    ("body", "failure"),
    [(CHAT, drop()), (STREAM_CHAT, drop()), (STREAM_CHAT, stream([], ending="break"))],
    ids=["closed-before-any-byte", "stream-closed-before-any-byte", "stream-closed-after-head"],
)
async def test_connection_dropped_before_first_byte_is_retried(pod_a, pod_b, body, failure):
    pod_a.script(failure)
    async with inproc_gateway(pod_a, pod_b) as g:
        assert served(await g.chat(body)) == (200, "pod-b", FROM_B)
        assert g.metric("kvgate_retries_total", model=MODEL, cause="dropped") == 1
        assert g.failures("pod-a") == 1


async def test_pod_is_ejected_after_m_failed_requests_and_no_longer_tried(pod_a, pod_b):
    pod_a.script(answer({}, status=500), answer({}, status=500))
    async with inproc_gateway(pod_a, pod_b, health={"eject_after_failed_requests": 2}) as g:
        first = await g.chat()
        assert g.in_rotation("pod-a")  # one failure of two: still in rotation
        second = await g.chat()
        third = await g.chat()
        assert [r.headers["x-kvgate-pod"] for r in (first, second, third)] == ["pod-b"] * 3
        assert g.in_rotation("pod-a") is False
        assert g.metric("kvgate_pod_ejections_total", pod="pod-a", cause="requests") == 1
        assert g.metric("kvgate_pod_healthy", pod="pod-a") == 0
        assert g.metric("kvgate_retries_total", model=MODEL, cause="status_500") == 2
        assert len(pod_a.received) == 2  # the third request went straight to pod-b


async def test_every_pod_failing_before_first_byte_is_502(pod_a, pod_b):
    for pod in (pod_a, pod_b):
        pod.script(answer({"error": "engine died"}, status=500))
    async with inproc_gateway(pod_a, pod_b) as g:
        err = assert_openai_error(await g.chat(), 502)
        assert "'pod-b' returned 500" in err["message"]  # the last pod tried
        assert g.metric("kvgate_retries_total", model=MODEL, cause="status_500") == 2
        assert g.metric("kvgate_requests_total", model=MODEL, status="502") == 1
