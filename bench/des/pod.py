"""One simulated pod in simulated time: slots, prefill lane, decode, tiered cache.

The request life mirrors the live simulated pod (``bench.sim.engine``) step for step:
FIFO wait for one of ``max_num_seqs`` slots; on admission a tiered-cache lookup and
promotion (``bench.podmodel.TieredCache``); tier loads; the prefill lane
(``prefill_concurrency``); L2 write-through at the first token; decode.

Decoding every token as an event would cost millions of events per hour of trace,
so decode runs on a per-pod *token clock*: all running requests emit tokens at the
same rate ``1 / itl(running)`` (the live pod sleeps ``itl(running)`` per token), so
one clock ``T = integral dt / itl(running)`` advanced whenever ``running`` changes
tells when each request's last token is due. One pending event per pod (the next
finisher) is kept, versioned so a stale one is skipped.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable

from bench.des.types import DesPodSpec, DesRequest, DesResult
from bench.podmodel import MemoryL2, Plan, TieredCache
from kvindex.store import IndexOp, Removed, Stored
from kvindex.types import Tier
from routing.core import Routed, RoutingCore

Schedule = Callable[[float, Callable[[object, float], None], object], None]
_EPS = 1e-9


class Job:
    """A request while a pod serves it."""

    __slots__ = ("request", "result", "routed", "plan", "keys", "pod")

    def __init__(self, request: DesRequest, result: DesResult, routed: Routed) -> None:
        self.request = request
        self.result = result
        self.routed = routed  # the routing core's record: decision and held load
        self.plan: Plan | None = None
        self.keys: list[int] = []
        self.pod: DesPod | None = None


class DesPod:
    """Queues, timing and cache of one pod; calls back into the fleet for index ops."""

    def __init__(
        self,
        name: str,
        spec: DesPodSpec,
        l2: MemoryL2 | None,
        schedule: Schedule,
        publish: Callable[[str, list[IndexOp]], None],
        finished: Callable[[Job, float], None],
        first_token: Callable[[Job, float], None] | None = None,
        seed: int = 0,
    ) -> None:
        self.name = name
        self.spec = spec
        self.timing = spec.timing
        self.cache = TieredCache(
            spec.l0_capacity_blocks, spec.l1_capacity_blocks, spec.l1_policy, l2, name
        )
        self.l2 = l2
        self._schedule = schedule
        self._publish = publish
        self._finished = finished
        self._first_token = first_token
        self.running = 0  # requests holding a slot (prefilling or decoding)
        self.waiting: deque[Job] = deque()
        self._lane_busy = 0
        self._lane: deque[Job] = deque()
        self.blocks_in_use = 0
        # Decode token clock.
        self._clock = 0.0
        self._clock_at = 0.0
        self._decoding: list[tuple[float, int, Job]] = []
        self._seq = 0
        self._version = 0
        # The step phases of ``PodTiming.step_phase_wait``: seeded by the run's seed and
        # the pod's name, so every strategy of a seed meets the same sequence of phases.
        self._rng = random.Random(f"{seed}:{name}")

    # -- slots ----------------------------------------------------------------

    def submit(self, job: Job, now: float) -> None:
        job.pod = self
        if self.running < self.spec.max_num_seqs and not self.waiting:
            self._admit(job, now)
        else:
            self.waiting.append(job)

    def _admit(self, job: Job, now: float) -> None:
        self._set_running(now, self.running + 1)
        req, spec = job.request, self.spec
        bs = spec.block_size
        job.result.queue_s = now - req.arrival_s
        keys = job.keys = list(req.block_keys[: req.prompt_tokens // bs])
        hit = self.cache.lookup(keys, req.prompt_tokens, bs)
        done = self.cache.admit(keys, hit)
        plan = job.plan = self.timing.plan(req.prompt_tokens, hit, bs)
        r = job.result
        r.l0_tokens, r.l1_tokens, r.l2_tokens = plan.l0_tokens, plan.l1_tokens, plan.l2_tokens
        if hit.l2 and self.l2 is not None:
            start = hit.l0 + hit.l1
            writer = self.l2.writer
            others = sum(1 for k in keys[start : start + hit.l2] if writer(k) != self.name)
            r.l2_cross_pod_tokens = others * bs
        ops: list[IndexOp] = []
        if done.l0.evicted:
            ops.append(Removed(Tier.L0, done.l0.evicted))
        if done.l0.held > hit.l0:
            ops.append(Stored(Tier.L0, keys[hit.l0 : done.l0.held]))
        if done.l1.stored:
            ops.append(Stored(Tier.L1, done.l1.stored))
        if done.l1.evicted:
            ops.append(Removed(Tier.L1, done.l1.evicted))
        if ops:
            self._publish(self.name, ops)
        blocks = -(-req.prompt_tokens // bs)
        self.blocks_in_use += blocks
        if plan.load_s > 0:
            self._schedule(now + plan.load_s, self._loaded, job)
        else:
            self._enter_lane(job, now)

    def _loaded(self, job: object, now: float) -> None:
        assert isinstance(job, Job)
        self._enter_lane(job, now)

    # -- prefill ----------------------------------------------------------------

    def _enter_lane(self, job: Job, now: float) -> None:
        limit = self.spec.prefill_concurrency
        if limit <= 0 or self._lane_busy < limit:
            if not self._lane_busy and self.timing.decode_waits_for_prefill:
                self._advance(now)  # decoding ran up to now; it stops for the prefill
                self._lane_busy += 1
                self._reschedule(now)
            else:
                self._lane_busy += 1
            self._schedule(now + self._lane_s(job, queued=False), self._prefilled, job)
        else:
            self._lane.append(job)

    def _lane_s(self, job: Job, queued: bool) -> float:
        """The job's time in the prefill lane, starting now (``PodTiming.lane_s``)."""
        assert job.plan is not None
        plan = job.plan
        return self.timing.lane_s(plan.uncached_tokens, self.running - 1, queued, self._rng,
                                  plan.cached_tokens)  # fmt: skip

    def _prefilled(self, job: object, now: float) -> None:
        assert isinstance(job, Job) and job.plan is not None
        stepped: list[Job] = []
        if self.timing.decode_waits_for_prefill:
            # The step that ended the prefill gave each decoding request one token;
            # the paused span is not decode time.
            self._clock_at = now
            self._clock += 1
            stepped = self._pop_due()
        self._lane_busy -= 1
        if self._lane:
            nxt = self._lane.popleft()
            self._lane_busy += 1
            self._schedule(now + self._lane_s(nxt, queued=True), self._prefilled, nxt)
        job.result.ttft_s = now - job.request.arrival_s
        RoutingCore.first_token(job.routed, job.result.ttft_s)
        if self._first_token is not None:
            self._first_token(job, now)
        self._write_l2(job)
        remaining = job.request.output_tokens - 1
        if remaining <= 0:
            self._finish(job, now)
        else:
            self._advance(now)
            self._seq += 1
            heapq.heappush(self._decoding, (self._clock + remaining, self._seq, job))
            self._reschedule(now)
        for done in stepped:
            self._finish(done, now)

    def _write_l2(self, job: Job) -> None:
        result = self.cache.write_l2(job.keys)
        if not self.spec.l2_events or not (result.stored or result.evicted):
            return
        ops: list[IndexOp] = []
        if result.stored:
            ops.append(Stored(Tier.L2, result.stored))
        if result.evicted:
            ops.append(Removed(Tier.L2, result.evicted))
        self._publish(self.name, ops)

    # -- decode token clock ---------------------------------------------------------

    def _decode_paused(self) -> bool:
        return self._lane_busy > 0 and self.timing.decode_waits_for_prefill

    def _advance(self, now: float) -> None:
        if self._decode_paused():
            self._clock_at = now
        elif now > self._clock_at:
            self._clock += (now - self._clock_at) / self.timing.itl_s(self.running)
            self._clock_at = now

    def _set_running(self, now: float, running: int) -> None:
        self._advance(now)
        self.running = running
        if self._decoding:
            self._reschedule(now)

    def _reschedule(self, now: float) -> None:
        self._version += 1
        if not self._decoding or self._decode_paused():
            return  # a paused clock is rescheduled when the prefill ends
        due = now + (self._decoding[0][0] - self._clock) * self.timing.itl_s(self.running)
        self._schedule(max(now, due), self._decode_due, self._version)

    def _decode_due(self, version: object, now: float) -> None:
        if version != self._version:
            return  # running changed since: a newer event is pending
        self._advance(now)
        for job in self._pop_due():
            self._finish(job, now)
        self._reschedule(now)

    def _pop_due(self) -> list[Job]:
        """The decoding requests whose last token the clock has reached."""
        done: list[Job] = []
        while self._decoding and self._decoding[0][0] <= self._clock + _EPS:
            done.append(heapq.heappop(self._decoding)[2])
        return done

    def _finish(self, job: Job, now: float) -> None:
        job.result.e2e_s = now - job.request.arrival_s
        self.blocks_in_use -= -(-job.request.prompt_tokens // self.spec.block_size)
        self._set_running(now, self.running - 1)
        self._finished(job, now)
        if self.waiting and self.running < self.spec.max_num_seqs:
            self._admit(self.waiting.popleft(), now)

    def kv_usage(self) -> float:
        return min(1.0, self.blocks_in_use / self.spec.l0_capacity_blocks)
