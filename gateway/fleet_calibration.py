"""kv-aware's online calibration pooled over the replicas sharing a Redis index.

Each process's calibrator (``routing.calibration``) fits the cost model's prefill and
per-running costs from the TTFTs it observes. N replicas behind a Service each observe
1/N of the requests, so each fits from a window that fills N times slower and from N
times fewer points: on the quick preset's RAG workload with four replicas, kv-aware's
TTFT p90 was 1.5x one replica's on seed 5 (twice) and 1.06x with calibration off
(docs/deploy.md, "Scaling out"). So with a Redis index the replicas pool their points:
every ``interval_s``, for each model it calibrates, a process appends the points it
added since (``RPUSH``), trims the model's list to the calibrator's window
(``LTRIM``) and reads it back (``LRANGE``), every model in one pipelined round trip,
then fits from the fleet's window (``Calibrator.adopt``). Every replica then fits
from the same points, the fleet's latest ``window``.

Keys: ``{kvgate:<ns>}:cal:<model>`` (the namespace's hash slot, so one round trip in a
Redis Cluster too), a list of at most ``window`` ``"x,r,y"`` strings, dropped an hour
after its last write. Bounded: the models are kv-aware's calibrators (``max_models``),
the points per model its window; a point that does not parse or lies outside what a
real request can give (another version's, a hostile write) is skipped. A failed round
costs its points' sharing only: they stay in this process's own window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

from redis.exceptions import RedisError

from gateway.logs import ThrottledError
from kvindex.redis_store import RedisStore
from routing.calibration import Calibrator, Point

log = logging.getLogger("kvgate.fleet_calibration")

KEY_TTL_S = 3600
# What a real point can hold: uncached tokens of one prompt, requests running beside
# it, seconds its prefill took once the predicted queue is taken out (negative when
# the queue was over-predicted).
MAX_TOKENS = 10_000_000
MAX_RUNNING = 1_000_000
MAX_ABS_SECONDS = 3600.0


def encode_point(point: Point) -> str:
    x, r, y = point
    return f"{x},{r},{y!r}"


def decode_point(raw: bytes | str) -> Point | None:
    """A point another replica wrote, or None if it is not one."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        xs, rs, ys = text.split(",")
        x, r, y = int(xs), int(rs), float(ys)
    except ValueError:
        return None
    if not (0 < x <= MAX_TOKENS and 0 <= r <= MAX_RUNNING):
        return None
    if not (math.isfinite(y) and abs(y) <= MAX_ABS_SECONDS):
        return None
    return x, r, y


class CalibrationExchange:
    """Pools this process's calibration points with the other replicas', every
    ``interval_s``; ``calibrators`` names what to pool (kv-aware's, per model)."""

    def __init__(
        self,
        redis: RedisStore,
        calibrators: Callable[[], list[tuple[str, Calibrator]]],
        *,
        interval_s: float = 1.0,
    ) -> None:
        self.redis = redis
        self._calibrators = calibrators
        self.interval_s = interval_s
        self.prefix = redis.root + "cal:"
        self.rounds = 0
        self.errors = 0
        self._task: asyncio.Task[None] | None = None
        self._log_unexpected = ThrottledError(log, "calibration exchange failed unexpectedly")

    async def exchange(self) -> None:
        """One round: push every model's new points, read back each model's window, fit."""
        models = self._calibrators()
        if not models:
            return
        new = [(model, cal, cal.take_new()) for model, cal in models]
        replies = await self.redis.on_namespace(lambda r: self._call(r, new))
        for (_, cal, _), window in zip(new, replies, strict=True):
            points = [p for raw in window if (p := decode_point(raw)) is not None]
            cal.adopt(points)  # at most a window: LRANGE reads no more
        self.rounds += 1

    async def _call(
        self, r: object, new: list[tuple[str, Calibrator, list[Point]]]
    ) -> list[list[bytes]]:
        pipe = r.pipeline(transaction=False)  # type: ignore[attr-defined]
        reads = []
        for model, cal, points in new:
            key = self.prefix + model
            if points:
                pipe.rpush(key, *(encode_point(p) for p in points))
                pipe.ltrim(key, -cal.window, -1)
                pipe.expire(key, KEY_TTL_S)
            reads.append(len(pipe))
            pipe.lrange(key, -cal.window, -1)  # bounded, whatever wrote the list
        replies = await pipe.execute()
        return [replies[i] for i in reads]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.exchange()
            except (TimeoutError, RedisError, OSError) as exc:
                self.errors += 1
                log.debug("calibration exchange failed: %r", exc)
            except Exception as exc:
                # A bug must cost this round, not the task (calibration would silently
                # go back to each replica's own points); logged in full once a minute.
                self.errors += 1
                self._log_unexpected(exc)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-fleet-calibration")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
