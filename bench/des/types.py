"""What the discrete-event simulator consumes and produces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.podmodel import L1_POLICIES, PodTiming
from bench.profiles import Profile

TIER_SETUPS = ("L0", "L0+L1", "L0+L1+L2")


@dataclass(frozen=True, slots=True)
class DesRequest:
    """One request: when it arrives, its size, and its prompt's full-block router keys."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: Sequence[int]  # chained keys of the prompt's full blocks, block 0 first
    session: str | None = None
    # Admission control (``FleetSim(admission=...)``): 0 is the most urgent priority.
    priority: int = 0
    tenant: str = ""
    slo_s: float | None = None  # TTFT SLO; None: the policy's default


@dataclass(slots=True)
class DesResult:
    """What happened to one request (times in simulated seconds)."""

    index: int
    pod: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    queue_s: float = 0.0  # waiting for a running slot
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    l0_tokens: int = 0
    l1_tokens: int = 0
    l2_tokens: int = 0
    l2_cross_pod_tokens: int = 0  # L2 tokens another pod wrote
    predicted_cached_tokens: int = 0
    predicted_ttft_s: float | None = None  # the strategy's prediction, when it makes one
    reason: str = ""
    priority: int = 0
    tenant: str = ""
    shed: str = ""  # admission control's reason when it answered 429 (the request never ran)
    gateway_wait_s: float = 0.0  # waiting at the gateway for admission (part of queue_s)

    @property
    def cached_tokens(self) -> int:
        return self.l0_tokens + self.l1_tokens + self.l2_tokens


@dataclass(frozen=True, slots=True)
class DesPodSpec:
    """Everything that defines one simulated pod in the DES (the fleet's pods are alike
    but for ``--pod-slowdown``, which slows a copy's timing: ``bench.des.sim.slowed_specs``)."""

    timing: PodTiming
    block_size: int
    l0_capacity_blocks: int
    l1_capacity_blocks: int = 0
    l2_capacity_blocks: int = 0  # 0: no L2
    l1_policy: str = "write-through"
    max_num_seqs: int = 256
    prefill_concurrency: int = 1  # 0: unlimited
    l2_events: bool = True  # False: LMCache fs:// (the index never hears of L2)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.l0_capacity_blocks <= 0 or self.max_num_seqs <= 0:
            raise ValueError("block size, L0 capacity and max_num_seqs must be positive")
        if self.l1_policy not in L1_POLICIES:
            raise ValueError(f"l1_policy must be one of {L1_POLICIES}")

    @classmethod
    def from_profile(cls, profile: Profile, block_size: int, tiers: str) -> DesPodSpec:
        """A profile's pod with the tiers of ``tiers`` (one of ``TIER_SETUPS``)."""
        if tiers not in TIER_SETUPS:
            raise ValueError(f"tiers must be one of {TIER_SETUPS}, got {tiers!r}")
        return cls(
            timing=profile.timing,
            block_size=block_size,
            l0_capacity_blocks=profile.blocks(profile.l0_capacity_tokens, block_size),
            l1_capacity_blocks=(
                profile.blocks(profile.l1_capacity_tokens, block_size) if "L1" in tiers else 0
            ),
            l2_capacity_blocks=(
                profile.blocks(profile.l2_capacity_tokens, block_size) if "L2" in tiers else 0
            ),
            max_num_seqs=profile.max_num_seqs,
        )
