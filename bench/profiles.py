"""Hardware/model profiles: the simulated pod's timing and the matching routing cost model.

A profile fixes what a simulated pod (live ``kvgate sim --profile NAME`` or the
discrete-event simulator) needs to behave like one GPU serving one model: alpha,
prefill rate, KV bytes per token, tier latencies and bandwidths, decode speed,
cache capacities. ``Profile.cost_model()`` gives kvgate's routing ``CostModel``
with the same numbers, so a benchmark measures routing, not a model mismatch.

Sources are in the comments next to each number. ``original`` is fitted to the
original deployment's published points; ``h200-llama8b`` takes its prefill, host
DRAM and memory-bandwidth numbers from ``python3 -m bench.gpu_timing`` on real
H200s (``docs/bench-gpu/run-*/gpu_timing.json``); the L40S and H100 profiles are derived
from datasheets with stated efficiency assumptions: treat them as plausible, not
measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.podmodel import PodTiming, TierTiming
from routing.cost_model import (
    QWEN2_7B_KV_BYTES_PER_TOKEN,
    CostModel,
    TierCost,
    fit_original_deployment,
)

GIB = 1 << 30
# Llama-3.1-8B: 32 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 B (bf16).
LLAMA31_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # 131,072 B = 128 KiB
LLAMA31_8B_WEIGHT_BYTES = 16.1e9  # 8.03e9 parameters x 2 B


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU + model: pod timing, cache capacities in tokens, and a description."""

    name: str
    description: str
    timing: PodTiming
    l0_capacity_tokens: int  # GPU KV cache (vLLM's "GPU KV cache size: N tokens")
    l1_capacity_tokens: int  # host DRAM given to KV offloading
    l2_capacity_tokens: int  # shared filesystem tier, whole fleet
    max_num_seqs: int = 256  # vLLM's default

    def blocks(self, tokens: int, block_size: int) -> int:
        return max(1, tokens // block_size)

    def sim_settings(self, block_size: int) -> dict[str, object]:
        """``SimConfig`` field values (capacities converted to blocks of ``block_size``)."""
        t = self.timing
        return {
            "overhead_s": t.overhead_s,
            "prefill_tokens_per_s": t.prefill_tokens_per_s,
            "kv_bytes_per_token": t.kv_bytes_per_token,
            "l1_latency_s": t.l1.latency_s,
            "l1_bandwidth_bytes_per_s": t.l1.bandwidth_bytes_per_s,
            "l2_latency_s": t.l2.latency_s,
            "l2_bandwidth_bytes_per_s": t.l2.bandwidth_bytes_per_s,
            "itl_s": t.itl_base_s,
            "itl_per_seq_s": t.itl_per_seq_s,
            "prefill_s_per_cached_token": t.prefill_s_per_cached_token,
            "l0_capacity_blocks": self.blocks(self.l0_capacity_tokens, block_size),
            "max_num_seqs": self.max_num_seqs,
        }

    def cost_model(self, block_size: int = 16) -> CostModel:
        """kvgate's routing cost model with this profile's numbers."""
        return cost_model_for(self.timing, block_size)


def cost_model_for(t: PodTiming, block_size: int = 16) -> CostModel:
    """The routing cost model that matches a pod timing model.

    Keeps the routing policy margins of ``CostModel`` (L2 ``min_speedup``) and its
    queueing estimates; only the physics is taken from the timing.
    """
    base = CostModel()
    return replace(
        base,
        kv_bytes_per_token=t.kv_bytes_per_token,
        prefill_tokens_per_s=t.prefill_tokens_per_s,
        prefill_overhead_s=t.overhead_s,
        l1=TierCost(t.l1.bandwidth_bytes_per_s, t.l1.latency_s, base.l1.min_speedup),
        l2=TierCost(t.l2.bandwidth_bytes_per_s, t.l2.latency_s, base.l2.min_speedup),
        decode_s_per_running=t.itl_per_seq_s * 5,  # ~5 decode steps share our prefill
        prefill_s_per_cached_token=t.prefill_s_per_cached_token,
        block_size=block_size,
    )


def sim_cost_model(overrides: dict[str, object], block_size: int) -> CostModel:
    """The cost model of simulated pods launched with ``sim_fleet(**overrides)``.

    What a user does for real hardware (configure kvgate with its numbers), done for
    the simulated fleet: the profile's settings, then the explicit overrides, then the
    simulator's defaults, exactly as ``kvgate sim`` resolves them.
    """
    from dataclasses import fields

    from bench.sim.config import SimConfig

    settings: dict[str, object] = {}
    profile = overrides.get("profile")
    if isinstance(profile, str):
        settings.update(get_profile(profile).sim_settings(block_size))
    known = {f.name for f in fields(SimConfig)}
    settings.update({k: v for k, v in overrides.items() if k in known})
    settings["block_size"] = block_size
    timing = SimConfig(**{k: v for k, v in settings.items() if k in known}).timing()
    return cost_model_for(timing, block_size)


def _original() -> Profile:
    # Fitted by routing.cost_model.fit_original_deployment to the original deployment's
    # published points (see routing/cost_model.py): Qwen2-7B fp16 on one A10G per replica,
    # LMCache fs:// on a shared Curvine mount as L2. 1,925 tokens from L2 in ~56 ms;
    # 2,500 tokens cold 774 ms vs L2 hit 287 ms; 500 tokens 0.99x.
    fit = fit_original_deployment()
    timing = PodTiming(
        overhead_s=fit.prefill_overhead_s,  # 89.7 ms
        prefill_tokens_per_s=1.0 / fit.prefill_s_per_token,  # 3,653 tokens/s
        kv_bytes_per_token=QWEN2_7B_KV_BYTES_PER_TOKEN,  # 56 KiB
        # L1 not measured there: PCIe Gen4 x16 (32 GB/s) at half efficiency, 1 ms; the same
        # estimate the routing CostModel uses.
        l1=TierTiming(0.001, 16e9),
        l2=TierTiming(fit.l2_latency_s, fit.l2_bandwidth_bytes_per_s),  # 124.6 ms, 1.97 GB/s
        # Decode is weight-bandwidth bound: 15.2 GB of weights / 600 GB/s (A10G GDDR6) = 25 ms
        # per step; each running sequence adds its KV read, ~2k tokens x 56 KiB / 600 GB/s.
        itl_base_s=0.025,
        itl_per_seq_s=0.0002,
    )
    # A10G 24 GiB x 0.9 utilisation - 15.2 GB weights - ~1.5 GB activations = ~5.9 GiB KV.
    return Profile(
        name="original",
        description="Qwen2-7B fp16 on A10G, LMCache fs:// L2 (fitted to published points)",
        timing=timing,
        l0_capacity_tokens=110_000,
        l1_capacity_tokens=600_000,  # 32 GiB of host DRAM / 56 KiB
        l2_capacity_tokens=20_000_000,  # ~1 TiB shared mount / 56 KiB
    )


def _l40s_llama8b() -> Profile:
    # ml.g6e.4xlarge: 1x NVIDIA L40S (48 GB GDDR6, 864 GB/s, 362 TFLOPS dense bf16),
    # 16 vCPU, 128 GiB RAM, 20 Gbit/s network (AWS instance page; NVIDIA L40S datasheet).
    timing = PodTiming(
        overhead_s=0.020,  # scheduler + kernel launches + sampling; estimate
        # 2 x 8.03e9 FLOP per token at ~45% MFU of 362 TFLOPS = ~10k tokens/s; vLLM reports
        # in the 8-10k range for 8B prefill on L40S-class parts, take 9k.
        prefill_tokens_per_s=9_000.0,
        kv_bytes_per_token=LLAMA31_8B_KV_BYTES_PER_TOKEN,
        l1=TierTiming(0.001, 20e9),  # PCIe Gen4 x16 pinned copies, ~20 GB/s effective
        # Shared FS over the 20 Gbit/s NIC: ~2.2 GB/s at best; 20 ms per-request lookup/open
        # cost (estimate; the original fit's 125 ms includes LMCache's own overheads).
        l2=TierTiming(0.020, 2.2e9),
        itl_base_s=0.020,  # 16.1 GB weights / 864 GB/s = 18.6 ms, plus launch overhead
        itl_per_seq_s=0.0003,  # ~2k tokens x 128 KiB / 864 GB/s per running sequence
    )
    return Profile(
        name="l40s-llama8b",
        description="Llama-3.1-8B bf16 on L40S (ml.g6e.4xlarge), shared FS L2 over 20 Gbit/s",
        timing=timing,
        l0_capacity_tokens=190_000,  # 48 GB x 0.9 - 16.1 GB - ~2 GB = ~25 GB / 128 KiB
        l1_capacity_tokens=500_000,  # 64 GiB of the 128 GiB host / 128 KiB
        l2_capacity_tokens=8_000_000,  # ~1 TiB shared / 128 KiB
    )


def _h100_llama8b() -> Profile:
    # H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA datasheet); p5-class
    # host with PCIe Gen5 and a fast shared filesystem (e.g. FSx for Lustre, ~10 GB/s/client).
    timing = PodTiming(
        overhead_s=0.010,
        # 16 GFLOP per token at ~40% MFU of 989 TFLOPS = ~25k tokens/s.
        prefill_tokens_per_s=25_000.0,
        kv_bytes_per_token=LLAMA31_8B_KV_BYTES_PER_TOKEN,
        l1=TierTiming(0.0005, 40e9),  # PCIe Gen5 x16 (64 GB/s) at ~60%
        l2=TierTiming(0.010, 10e9),
        itl_base_s=0.006,  # 16.1 GB / 3.35 TB/s = 4.8 ms plus launch overhead
        itl_per_seq_s=0.0001,  # ~2k tokens x 128 KiB / 3.35 TB/s
    )
    return Profile(
        name="h100-llama8b",
        description="Llama-3.1-8B bf16 on H100 SXM 80 GB, fast shared FS L2",
        timing=timing,
        l0_capacity_tokens=400_000,  # 80 GB x 0.9 - 16.1 GB - ~4 GB = ~52 GB / 128 KiB
        l1_capacity_tokens=2_000_000,  # 256 GiB of host DRAM / 128 KiB
        l2_capacity_tokens=16_000_000,  # ~2 TiB shared / 128 KiB
    )


# Where ``h200-llama8b``'s numbers come from: three runs of ``python3 -m bench.gpu_timing``.
H200_MEASUREMENTS = tuple(f"docs/bench-gpu/run-{n}/gpu_timing.json" for n in (1, 2, 3))


def _h200_llama8b() -> Profile:
    # Measured on H200s (141 GB HBM3e) of three lease machines, 2026-12-04, with a
    # Llama-3.1-8B-shaped bf16 model in transformers (SDPA); H200_MEASUREMENTS.
    timing = PodTiming(
        # The line through the compute-bound prefills (1,024-4,096 uncached tokens) is
        # 33.5k, 35.0k and 34.8k tokens/s in the three runs: ~550 TFLOP/s. It replaces
        # the H100 profile's guess of 25k (same matmul rate). The fixed cost is not a
        # GPU number: transformers' eager launches put a floor of 18-32 ms (the
        # machines' host CPUs) under the shortest prefill, which vLLM's CUDA graphs cut;
        # the compute line's intercept is 0.6-3.8 ms. 10 ms, the H100 estimate, lies
        # between.
        overhead_s=0.010,
        prefill_tokens_per_s=34_000.0,
        kv_bytes_per_token=LLAMA31_8B_KV_BYTES_PER_TOKEN,
        # Pinned host memory to the GPU, one copy per layer for K and for V (64 copies a
        # load), 16-4,096 tokens: 0.17-0.31 ms + bytes / 53.9-56.1 GB/s.
        l1=TierTiming(0.0003, 55e9),
        # Not measured: the lease has no shared filesystem. Its local disk read 2-512 MiB
        # files into pinned memory at ~1.7 GB/s (2.2-2.4 ms for one 16-token file), a
        # floor for one disk; a shared pool striped over many is faster. The H100
        # profile's estimate is kept, so the two differ only in what was measured.
        l2=TierTiming(0.010, 10e9),
        # A decode step of the model's weights replayed as a CUDA graph, as vLLM runs
        # decode (run 3): 5.74 ms + 34.8 us per sequence at a 1,024-token context, above
        # the 3.8 ms floor of reading 16.1 GB at the measured 4.2 TB/s. vLLM's scheduler
        # and sampler come on top. The per-sequence cost is its KV read (1,024 x 128
        # KiB / 4.2 TB/s = 32 us): 70 us at the ~2k-token contexts served.
        itl_base_s=0.0057,
        itl_per_seq_s=0.00007,
        # One layer's flash attention of 512 new tokens behind 0-8,192 cached ones, x 32
        # layers: ~1.1 ms + 1.13 us (run 2) and 0.96 us (run 3) per cached token.
        prefill_s_per_cached_token=1.05e-6,
    )
    return Profile(
        name="h200-llama8b",
        description="Llama-3.1-8B bf16 on H200 141 GB (prefill, L1, HBM measured), shared FS L2",
        timing=timing,
        l0_capacity_tokens=800_000,  # 141 GB x 0.9 - 16.1 GB - ~4 GB = ~107 GB / 128 KiB
        l1_capacity_tokens=2_000_000,  # 256 GiB of host DRAM / 128 KiB
        l2_capacity_tokens=16_000_000,  # ~2 TiB shared / 128 KiB
    )


PROFILES: dict[str, Profile] = {
    p.name: p for p in (_original(), _l40s_llama8b(), _h100_llama8b(), _h200_llama8b())
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
