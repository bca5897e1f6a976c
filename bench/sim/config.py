"""Configuration of one simulated vLLM pod.

The simulator stands in for what a CPU machine cannot do (GPU timing, many pods,
cache tiers), so every knob here is either a vLLM setting it mirrors (model name,
block size, max-num-seqs, KV-events config) or a timing constant of the simple
cost model it plays back: ``TTFT = queueing + overhead_s + uncached / prefill_rate``
and one output token every ``itl_s``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bench.tinymodel import MODEL_NAME


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """The subset of vLLM's ``--kv-events-config`` the simulator honours.

    ``old_shape`` (positional arrays, vLLM <= 0.23) and ``bytes_hashes``
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) exist so decoder tests can be fed
    every wire variant a real fleet may emit.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    old_shape: bool = False
    bytes_hashes: bool = False


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything that defines one simulated pod; immutable once the app is built."""

    model: str = MODEL_NAME
    tokenizer: Path | None = None  # None: bench.tinymodel.ensure_tokenizer()
    max_model_len: int = 4096
    block_size: int = 32
    l0_capacity_blocks: int = 4096
    # Timing model.
    overhead_s: float = 0.002  # alpha: fixed per-request scheduling/launch cost
    prefill_tokens_per_s: float = 50_000.0
    itl_s: float = 0.001  # inter-token latency while decoding
    prefill_concurrency: int = 1  # prefills computed at once (0 = unlimited)
    default_max_tokens: int = 16
    max_num_seqs: int = 256  # running requests; the rest wait in a FIFO queue
    seed: int = 0  # output-token generator seed
    # Engine block-hash seed. vLLM seeds NONE_HASH per process (random unless
    # PYTHONHASHSEED is set, for its non-cryptographic hashes); a random default
    # keeps anything downstream from depending on the engine's hash values.
    hash_seed: str = field(default_factory=lambda: os.urandom(16).hex())
    kv_events: KVEventsSettings | None = None
    engine_index: int = 0  # the ``engine`` label of vLLM's metrics
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.l0_capacity_blocks <= 0:
            raise ValueError("l0_capacity_blocks must be positive")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if min(self.overhead_s, self.itl_s) < 0:
            raise ValueError("timings must not be negative")

    def tokenizer_dir(self) -> Path:
        """The tokenizer directory, building the tiny one on first use."""
        if self.tokenizer is not None:
            return Path(self.tokenizer)
        from bench.tinymodel import ensure_tokenizer

        return ensure_tokenizer()
