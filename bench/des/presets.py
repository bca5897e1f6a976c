"""The fleet benchmark's presets in simulated time: ``kvgate bench des --preset quick``.

The same prompts, arrivals, pods and kv-aware cost model as ``kvgate bench fleet
--preset NAME`` (and ``kvgate bench quick``), so a routing change can be tried over
many seeds in seconds before one live run confirms it:

* prompts: ``bench.quick.build_workloads`` (same seed, same text), rendered with the
  pods' chat template and keyed like the gateway (``chat_to_des``);
* arrivals: the preset's load, drawn like ``bench.fleet`` draws it (Poisson gaps
  seeded with the run's seed; closed loop as sessions);
* pods: the preset's ``SimConfig`` overrides and tier setup (L1 capacity from the
  preset, the simulator's default L2 size, write-through L1 and L2, L2 events on);
* kv-aware: ``sim_cost_model`` of the same overrides, as the fleet bench configures it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.des.types import TIER_SETUPS, DesPodSpec, DesRequest
from bench.des.workload import chat_to_des
from bench.fleet import Load
from bench.quick import PRESETS, Preset, build_workloads
from bench.tinymodel import MODEL_NAME, ensure_tokenizer
from bench.workloads import Workload, poisson_arrivals

PRESET_BLOCK_SIZE = 32  # FleetPlan.block_size: the simulated pods' block size


@dataclass(frozen=True)
class PresetInput:
    """One workload of a preset under one load, ready for ``run_des``."""

    workload: str
    load: str  # Load.label, as in the fleet report
    requests: list[DesRequest] | list[list[DesRequest]]  # sessions when closed loop
    concurrency: int | None  # closed-loop users, None for open loop

    @property
    def size(self) -> int:
        reqs = self.requests
        if self.concurrency is None:
            return len(reqs)
        return sum(len(s) for s in reqs)  # type: ignore[arg-type]


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def preset_spec(preset: Preset, tiers: str, block_size: int = PRESET_BLOCK_SIZE) -> DesPodSpec:
    """The preset's simulated pod with the tier setup ``tiers``."""
    from bench.sim.config import SimConfig

    if tiers not in TIER_SETUPS:
        raise ValueError(f"tiers must be one of {TIER_SETUPS}, got {tiers!r}")
    cfg = SimConfig(**{**preset.pod_config, "block_size": block_size})
    return DesPodSpec(
        timing=cfg.timing(),
        block_size=block_size,
        l0_capacity_blocks=cfg.l0_capacity_blocks,
        l1_capacity_blocks=preset.l1_capacity_blocks if "L1" in tiers else 0,
        l2_capacity_blocks=cfg.l2_capacity_blocks if "L2" in tiers else 0,
        l1_policy=cfg.l1_policy,
        max_num_seqs=cfg.max_num_seqs,
        prefill_concurrency=cfg.prefill_concurrency,
    )


def kv_aware_options(preset: Preset, block_size: int = PRESET_BLOCK_SIZE) -> dict[str, Any]:
    """kv-aware's options as ``bench.fleet`` sets them (``KVGATE_STRATEGY_OPTIONS``)."""
    from bench.profiles import sim_cost_model

    return {"cost_model": sim_cost_model(dict(preset.pod_config), block_size).to_dict()}


def _des_requests(workload: Workload, at_s: Sequence[float], block_size: int) -> list[DesRequest]:
    reqs = workload.requests()
    return chat_to_des(
        [r.messages for r in reqs],
        [r.max_tokens for r in reqs],
        list(at_s),
        ensure_tokenizer(),
        MODEL_NAME,
        block_size,
    )


def preset_inputs(
    preset: Preset,
    workloads: Sequence[str] | None = None,
    seed: int = 0,
    block_size: int = PRESET_BLOCK_SIZE,
) -> list[PresetInput]:
    """Every (workload, load) of the preset as DES requests, like ``run_fleet`` drives them."""
    names = list(workloads or preset.workloads)
    out: list[PresetInput] = []
    for workload in build_workloads(names, preset, preset.pods, seed):
        loads = [Load("trace")] if workload.timed else [Load.parse(x) for x in preset.loads]
        out += [workload_input(workload, load, seed, block_size) for load in loads]
    return out


def workload_input(workload: Workload, load: Load, seed: int, block_size: int) -> PresetInput:
    """``workload`` under ``load`` as DES requests, like ``run_fleet`` drives it."""
    reqs = workload.requests()
    if workload.timed or load.kind == "trace":
        at = [r.at_s for r in reqs]
    elif load.kind == "poisson":
        at = [r.at_s for r in poisson_arrivals(reqs, load.value, seed)]
    else:  # closed loop: sessions in order, each one's turns after the previous
        flat = _des_requests(workload, [0.0] * len(reqs), block_size)
        sessions: list[list[DesRequest]] = [[] for _ in workload.sessions]
        for (si, _turn), req in zip(_turn_major_positions(workload), flat, strict=True):
            sessions[si].append(req)
        return PresetInput(workload.name, load.label, sessions, int(load.value))
    return PresetInput(workload.name, load.label, _des_requests(workload, at, block_size), None)


def _turn_major_positions(workload: Workload) -> list[tuple[int, int]]:
    """(session, turn) of each request in ``Workload.requests()`` order."""
    rounds = max((len(s) for s in workload.sessions), default=0)
    return [(i, r) for r in range(rounds) for i, s in enumerate(workload.sessions) if r < len(s)]
