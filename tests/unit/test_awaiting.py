"""``gateway.awaiting``: what a pod lost to its probes gives up."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from gateway.accounting import Attempt
from gateway.awaiting import AwaitingPods
from gateway.config import PodConfig
from gateway.pods import Pod


def _attempt(pod: Pod) -> Attempt:
    return Attempt(pod, cast(Any, None), 0.0, "m")  # the routing record is not read


async def test_a_lost_pod_cancels_the_attempts_waiting_on_it_and_marks_them_lost() -> None:
    lost, kept = Pod(PodConfig(name="a", url="http://a")), Pod(PodConfig(name="b", url="http://b"))
    awaiting = AwaitingPods()
    attempts: list[Attempt] = []
    started = asyncio.Event()

    async def serve(pod: Pod) -> str:
        a = _attempt(pod)
        attempts.append(a)
        awaiting.enter(a)
        try:
            if len(attempts) == 3:
                started.set()
            await asyncio.sleep(30)  # the pod's answer, which never comes
            return "answered"
        except asyncio.CancelledError:
            return "lost" if a.lost else "cancelled"
        finally:
            awaiting.leave(a)

    tasks = [asyncio.create_task(serve(p)) for p in (lost, lost, kept)]
    await started.wait()
    assert (awaiting.waiting("a"), awaiting.waiting("b")) == (2, 1)

    awaiting.pod_lost(lost)
    done, pending = await asyncio.wait(tasks, timeout=1)

    assert [t.result() for t in tasks[:2]] == ["lost", "lost"]
    assert pending == {tasks[2]} and not attempts[2].lost  # another pod's: untouched
    assert (awaiting.waiting("a"), awaiting.waiting("b")) == (0, 1)
    tasks[2].cancel()
    assert await tasks[2] == "cancelled"
    assert awaiting.waiting("b") == 0


async def test_an_attempt_that_left_before_its_pod_was_lost_goes_on() -> None:
    """One whose client has its first byte (the proxy calls ``leave`` before sending
    it) cannot change pods, so it is not cancelled."""
    pod = Pod(PodConfig(name="a", url="http://a"))
    awaiting = AwaitingPods()
    answering = asyncio.Event()

    async def serve() -> str:
        a = _attempt(pod)
        awaiting.enter(a)
        awaiting.leave(a)  # about to send the client its status line
        answering.set()
        await asyncio.sleep(0.05)  # relaying the rest
        return "answered"

    task = asyncio.create_task(serve())
    await answering.wait()
    awaiting.pod_lost(pod)
    assert await task == "answered"


async def test_an_attempt_whose_call_failed_is_not_given_up_during_its_retry_handling() -> None:
    """``holding`` leaves the table when the call ends, however: a pod lost while the
    proxy backs off before a retry must not cancel the request (its cancellation
    would land outside the handler that turns it into a retry)."""
    pod = Pod(PodConfig(name="a", url="http://a"))
    awaiting = AwaitingPods()
    backing_off = asyncio.Event()

    async def serve() -> str:
        a = _attempt(pod)
        try:
            with awaiting.holding(a):
                raise ConnectionError("the pod answered 503")
        except ConnectionError:
            backing_off.set()
            await asyncio.sleep(0.05)  # the retry's backoff
            return "retried"

    task = asyncio.create_task(serve())
    await backing_off.wait()
    assert awaiting.waiting("a") == 0
    awaiting.pod_lost(pod)
    assert await task == "retried"


class _Watch:
    def __init__(self) -> None:
        self.told = 0

    def pod_lost(self) -> None:
        self.told += 1


async def test_a_lost_pod_tells_the_streams_it_feeds_and_no_other_pods() -> None:
    """A stream whose client has its status line cannot change pods: its watch is told
    (the proxy's ``_QuietPod`` then ends it if the pod stays quiet), while it relays."""
    lost, kept = Pod(PodConfig(name="a", url="http://a")), Pod(PodConfig(name="b", url="http://b"))
    awaiting = AwaitingPods()
    on_lost, on_kept, finished = _Watch(), _Watch(), _Watch()
    with awaiting.relaying(_attempt(lost), finished):
        pass  # a stream that ended before the pod was lost
    with awaiting.relaying(_attempt(lost), on_lost), awaiting.relaying(_attempt(kept), on_kept):
        assert (awaiting.relayed("a"), awaiting.relayed("b")) == (1, 1)
        awaiting.pod_lost(lost)
        assert (on_lost.told, on_kept.told, finished.told) == (1, 0, 0)
        assert (awaiting.relayed("a"), awaiting.relayed("b")) == (0, 1)
    assert awaiting.relayed("b") == 0
