"""A task stopped just as what it waits on fires must stop.

On Python 3.11 ``asyncio.wait_for`` returns normally when a cancel lands in the same
loop iteration as the awaited thing completes (CPython gh-86296): the subscriber's
read loop then ran on, waited for a socket that would never speak again, and
``stop()`` awaited it for ever (a CI run hung 600 s in the live-event benchmark's
test). ruff bans ``asyncio.wait_for`` (TID251); this pins the subscriber's wait.
"""

import asyncio
import time

import pytest

from kvindex.events.subscriber import _wait_readable


@pytest.mark.parametrize("deadline_s", [None, 5.0])
async def test_a_cancel_that_lands_as_the_socket_turns_readable_is_kept(deadline_s):
    readable = asyncio.Event()
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    task = asyncio.create_task(_wait_readable(readable, deadline))
    await asyncio.sleep(0)  # the task now waits on the event
    readable.set()  # the descriptor fires ...
    task.cancel()  # ... and stop() cancels in the same loop iteration
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_deadline_still_ends_the_wait():
    readable = asyncio.Event()
    started = time.monotonic()
    await _wait_readable(readable, time.monotonic() + 0.05)
    assert 0.04 <= time.monotonic() - started < 1.0
    assert not readable.is_set()
