"""``kvgate sim`` / ``python -m bench.sim``: run one simulated vLLM pod.

Flags mirror vLLM's where one exists (``--port``, ``--served-model-name``,
``--block-size``, ``--max-num-seqs``, ``--kv-events-config`` …); the rest set the
timing model and the L0 capacity.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.sim.config import KVEventsSettings, SimConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig(hash_seed="")
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    a("--port", type=int, default=8000)
    a("--served-model-name", default=d.model, help="model name the API answers to")
    a("--tokenizer", type=Path, default=None, help="tokenizer dir (default: the tiny one)")
    a("--block-size", type=int, default=d.block_size)
    a("--max-model-len", type=int, default=d.max_model_len)
    a("--max-num-seqs", type=int, default=d.max_num_seqs, help="running requests; rest queue")
    a("--l0-capacity-blocks", type=int, default=d.l0_capacity_blocks, help="GPU prefix cache")
    a("--overhead-ms", type=float, default=d.overhead_s * 1e3, help="fixed cost per request")
    a("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    a("--prefill-concurrency", type=int, default=d.prefill_concurrency,
      help="prefills computed at once (0: unlimited)")  # fmt: skip
    a("--itl-ms", type=float, default=d.itl_s * 1e3, help="inter-token latency")
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
    a("--log-level", default="warning")


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


def config_from_args(args: argparse.Namespace) -> SimConfig:
    extra = {} if args.hash_seed is None else {"hash_seed": args.hash_seed}
    return SimConfig(
        model=args.served_model_name,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        l0_capacity_blocks=args.l0_capacity_blocks,
        overhead_s=args.overhead_ms / 1e3,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        prefill_concurrency=args.prefill_concurrency,
        itl_s=args.itl_ms / 1e3,
        default_max_tokens=args.default_max_tokens,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        kv_events=parse_kv_events(
            args.kv_events_config, args.kv_events_old_shape, args.kv_events_bytes_hashes
        ),
        data_parallel_rank=args.data_parallel_rank,
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
