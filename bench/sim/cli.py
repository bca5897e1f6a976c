"""``kvgate sim`` / ``python -m bench.sim``: run one simulated vLLM pod.

Flags mirror vLLM's where one exists (``--port``, ``--served-model-name``,
``--block-size``, ``--max-num-seqs``, ``--kv-events-config`` …); the rest set the
timing model (``--profile`` for a whole hardware/model set, single flags override
it) and the cache tiers (L0 capacity, ``--l1-*`` host DRAM, ``--l2-*`` shared dir).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from bench.podmodel import L1_POLICIES
from bench.profiles import PROFILES, get_profile
from bench.sim.config import L2_EVENT_MODES, KVEventsSettings, SimConfig

# Flags a profile may set: flag dest -> (SimConfig field, scale from flag units).
_TIMED = {
    "overhead_ms": ("overhead_s", 1e-3),
    "prefill_tokens_per_s": ("prefill_tokens_per_s", 1.0),
    "itl_ms": ("itl_s", 1e-3),
    "itl_per_seq_ms": ("itl_per_seq_s", 1e-3),
    "prefill_ms_per_running": ("prefill_s_per_running", 1e-3),
    "prefill_us_per_cached_token": ("prefill_s_per_cached_token", 1e-6),
    "queued_overhead_share": ("queued_overhead_share", 1.0),
    "kv_bytes_per_token": ("kv_bytes_per_token", 1),
    "l0_capacity_blocks": ("l0_capacity_blocks", 1),
    "max_num_seqs": ("max_num_seqs", 1),
    "l1_latency_ms": ("l1_latency_s", 1e-3),
    "l1_gb_per_s": ("l1_bandwidth_bytes_per_s", 1e9),
    "l2_latency_ms": ("l2_latency_s", 1e-3),
    "l2_gb_per_s": ("l2_bandwidth_bytes_per_s", 1e9),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig(hash_seed="")
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    a("--port", type=int, default=8000)
    a("--served-model-name", default=d.model, help="model name the API answers to")
    a("--tokenizer", type=Path, default=None, help="tokenizer dir (default: the tiny one)")
    a("--block-size", type=int, default=d.block_size)
    a("--max-model-len", type=int, default=d.max_model_len)
    a("--profile", default=None, choices=sorted(PROFILES),
      help="hardware/model timing and capacities; single flags override it")  # fmt: skip
    a("--max-num-seqs", type=int, default=None,
      help=f"running requests; rest queue (default {d.max_num_seqs})")  # fmt: skip
    a("--l0-capacity-blocks", type=int, default=None,
      help=f"GPU prefix cache (default {d.l0_capacity_blocks})")  # fmt: skip
    a("--overhead-ms", type=float, default=None,
      help=f"alpha: fixed cost per prefill (default {d.overhead_s * 1e3:g})")  # fmt: skip
    a("--prefill-tokens-per-s", type=float, default=None,
      help=f"prefill rate (default {d.prefill_tokens_per_s:g})")  # fmt: skip
    a("--prefill-concurrency", type=int, default=d.prefill_concurrency,
      help="prefills computed at once (0: unlimited)")  # fmt: skip
    a("--itl-ms", type=float, default=None,
      help=f"inter-token latency of a batch of one (default {d.itl_s * 1e3:g})")  # fmt: skip
    a("--itl-per-seq-ms", type=float, default=None,
      help="inter-token latency added per running request (default 0)")  # fmt: skip
    a("--prefill-ms-per-running", type=float, default=None,
      help="added to a prefill per other running request (default 0; a CPU engine's "
           "steps carry the running batch)")  # fmt: skip
    a("--prefill-us-per-cached-token", type=float, default=None,
      help="added to a prefill per cached token before it (default 0; attention reads "
           "the cached keys)")  # fmt: skip
    a("--queued-overhead-share", type=float, default=None,
      help="share of the fixed cost a prefill queued behind another pays (default 1: "
           "one at a time; vLLM batches prefills that arrive together)")  # fmt: skip
    a(
        "--step-phase-wait",
        action="store_true",
        help="a prefill beside running requests first waits a random share of a step",
    )
    a(
        "--decode-waits-for-prefill",
        action="store_true",
        help="decoding requests get one token per prefill and wait out its compute (a CPU "
        "engine's steps carry the prefill beside the decodes)",
    )
    a("--kv-bytes-per-token", type=int, default=None,
      help=f"KV bytes per token, sizes loads (default {d.kv_bytes_per_token})")  # fmt: skip
    _add_tier_arguments(parser, d)
    a("--default-max-tokens", type=int, default=d.default_max_tokens)
    a("--seed", type=int, default=d.seed, help="output token generator seed")
    a("--hash-seed", default=None,
      help="engine block-hash seed (default random per process; 'vllm-none-hash' is "
           "vLLM 0.32's sha256 default)")  # fmt: skip
    a("--kv-events-config", default=None,
      help="vLLM-style JSON, e.g. '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\","
           "\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\","
           "\"topic\":\"kv-events\"}'")  # fmt: skip
    a("--kv-events-old-shape", action="store_true", help="positional events (vLLM <= 0.23)")
    a("--kv-events-bytes-hashes", action="store_true", help="raw digest hashes, not uint64")
    a("--data-parallel-rank", type=int, default=0, help="offsets event ports like vLLM")
    a("--lora-modules", nargs="*", default=[], metavar="NAME[=PATH]",
      help="LoRA adapters served from the start (like vLLM's; the path is ignored)")  # fmt: skip
    a("--allow-runtime-lora-updating", action="store_true",
      default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
      help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (default: vLLM's env "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")  # fmt: skip
    a("--log-level", default="warning")


def _add_tier_arguments(parser: argparse.ArgumentParser, d: SimConfig) -> None:
    a = parser.add_argument
    a("--l1-capacity-blocks", type=int, default=d.l1_capacity_blocks,
      help="host-DRAM tier (KV events medium CPU); 0 disables it")  # fmt: skip
    a("--l1-policy", choices=L1_POLICIES, default=d.l1_policy,
      help="write-through: every computed block; evict: what L0 evicts")  # fmt: skip
    a("--l1-latency-ms", type=float, default=None, help="fixed cost of an L1 load")
    a("--l1-gb-per-s", type=float, default=None, help="L1 load bandwidth, GB/s")
    a("--l2-dir", type=Path, default=None,
      help="directory shared by the fleet's pods: enables L2 (medium STORAGE, REMOTE)")  # fmt: skip
    a("--l2-capacity-blocks", type=int, default=d.l2_capacity_blocks,
      help="files the L2 directory keeps (least recently used go first)")  # fmt: skip
    a("--l2-latency-ms", type=float, default=None, help="fixed cost of an L2 load")
    a("--l2-gb-per-s", type=float, default=None, help="L2 load bandwidth, GB/s")
    a("--l2-hash-seed", default=d.l2_hash_seed,
      help="block-hash seed of L2 file names; the same on every pod of a fleet")  # fmt: skip
    a("--l2-events", choices=L2_EVENT_MODES, default=d.l2_events,
      help="storage: STORAGE/REMOTE KV events; none: like LMCache fs://, no events")  # fmt: skip
    a("--pod-name", default="", help="this pod's name, written into its L2 files")


def parse_kv_events(
    raw: str | None, old_shape: bool, bytes_hashes: bool
) -> KVEventsSettings | None:
    """vLLM's ``--kv-events-config`` JSON; None when events are off."""
    if not raw:
        return None
    cfg = json.loads(raw)
    if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") == "null":
        return None
    base = KVEventsSettings()
    return KVEventsSettings(
        endpoint=cfg.get("endpoint", base.endpoint),
        replay_endpoint=cfg.get("replay_endpoint"),
        topic=cfg.get("topic", base.topic),
        buffer_steps=int(cfg.get("buffer_steps", base.buffer_steps)),
        hwm=int(cfg.get("hwm", base.hwm)),
        old_shape=old_shape,
        bytes_hashes=bytes_hashes,
    )


def timing_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Profile values (if any) overlaid by every timing/capacity flag actually given."""
    settings: dict[str, Any] = {}
    if args.profile:
        settings.update(get_profile(args.profile).sim_settings(args.block_size))
    for dest, (name, scale) in _TIMED.items():
        value = getattr(args, dest, None)
        if value is not None:
            settings[name] = value * scale if scale != 1 else value
    return settings


def config_from_args(args: argparse.Namespace) -> SimConfig:
    extra: dict[str, Any] = {} if args.hash_seed is None else {"hash_seed": args.hash_seed}
    return SimConfig(
        model=args.served_model_name,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        prefill_concurrency=args.prefill_concurrency,
        step_phase_wait=args.step_phase_wait,
        decode_waits_for_prefill=args.decode_waits_for_prefill,
        default_max_tokens=args.default_max_tokens,
        seed=args.seed,
        kv_events=parse_kv_events(
            args.kv_events_config, args.kv_events_old_shape, args.kv_events_bytes_hashes
        ),
        data_parallel_rank=args.data_parallel_rank,
        lora_modules=tuple(m.split("=", 1)[0] for m in args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        l1_capacity_blocks=args.l1_capacity_blocks,
        l1_policy=args.l1_policy,
        l2_dir=args.l2_dir,
        l2_capacity_blocks=args.l2_capacity_blocks,
        l2_hash_seed=args.l2_hash_seed,
        l2_events=args.l2_events,
        pod_name=args.pod_name or f"{args.host}:{args.port}",
        **timing_settings(args),
        **extra,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the process exit code."""
    import uvicorn

    from bench.sim.app import create_app

    app = create_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate sim", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
