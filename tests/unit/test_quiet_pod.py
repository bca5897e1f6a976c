"""The proxy's watch on a stream's silence (``gateway.proxy._QuietPod``), before and
after its pod is lost to its probes (``gateway.awaiting``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.proxy import _QuietPod


async def _relay(chunks_every_s: float | None, lose_after_s: float, idle_s: float | None):
    """A relay that gets a chunk each ``chunks_every_s`` (None: never) for up to 3 s,
    whose pod is lost after ``lose_after_s``: (the watch, seconds until the relay
    ended, whether it timed out)."""
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    timed_out = False
    try:
        async with asyncio.timeout(3.0) as deadline:
            quiet = _QuietPod(loop, deadline, idle_s, lost_grace_s=0.2)
            loop.call_later(lose_after_s, quiet.pod_lost)
            while True:
                await asyncio.sleep(chunks_every_s or 10)
                quiet.last = loop.time()
    except TimeoutError:
        timed_out = True
    finally:
        quiet.stop()
    return quiet, time.monotonic() - start, timed_out


async def test_a_quiet_stream_ends_at_once_when_its_pod_is_lost() -> None:
    # silent for 0.4 s when the pod is lost, past the 0.2 s grace: ended then
    quiet, took_s, timed_out = await _relay(None, lose_after_s=0.4, idle_s=60.0)
    assert timed_out and quiet.fired and quiet.lost
    assert took_s == pytest.approx(0.4, abs=0.15)
    assert quiet.what("nothing") == "stopped answering its probes and sent nothing for 0.2 s"


async def test_a_stream_its_lost_pod_still_feeds_goes_on_until_it_goes_quiet() -> None:
    # chunks every 50 ms: the lost pod still answers this stream, which runs on to
    # its own deadline
    quiet, took_s, timed_out = await _relay(0.05, lose_after_s=0.1, idle_s=None)
    assert timed_out and quiet.lost and not quiet.fired
    assert took_s == pytest.approx(3.0, abs=0.3)


async def test_without_an_idle_limit_nothing_fires_until_the_pod_is_lost() -> None:
    # the first byte of a stream whose status line went out: no idle limit (first_byte_s
    # bounds it) until its pod is lost; then, silent for longer than the grace, it ends
    quiet, took_s, timed_out = await _relay(None, lose_after_s=1.0, idle_s=None)
    assert timed_out and quiet.fired
    assert took_s == pytest.approx(1.0, abs=0.15)


async def test_a_pod_gone_quiet_mid_stream_is_found_idle_s_after_its_last_chunk() -> None:
    """The timer is not re-armed per chunk, but where it is re-armed matters: from the
    check (as it was) a pod quiet since just after one check was found up to 2x
    ``idle_s`` later; from the last chunk, ``idle_s`` later."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(5.0) as deadline:
        quiet = _QuietPod(loop, deadline, idle_s=0.5, lost_grace_s=0.2)
        try:
            while loop.time() - start < 0.55:  # chunks past the first check (at 0.5 s)
                await asyncio.sleep(0.02)
                quiet.last = loop.time()
            last_chunk = loop.time()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(5)  # the pod's silence
        finally:
            quiet.stop()
            assert quiet.fired
            assert loop.time() - last_chunk == pytest.approx(0.5, abs=0.1)
