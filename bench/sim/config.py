"""Configuration of one simulated vLLM pod.

The simulator stands in for what a CPU machine cannot do (GPU timing, many pods,
cache tiers), so every knob here is either a vLLM setting it mirrors (model name,
block size, max-num-seqs, KV-events config) or a constant of the timing model it
plays back (``bench.podmodel``): ``TTFT = queueing + tier loads + overhead_s +
uncached / prefill_rate``, one output token every ``itl_s + itl_per_seq_s x
running``. ``bench.profiles`` holds sets of these constants for real hardware.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bench.podmodel import L1_POLICIES, PodTiming, TierTiming
from bench.tinymodel import MODEL_NAME

L2_EVENT_MODES = ("storage", "none")  # STORAGE/REMOTE events, or none (LMCache fs://)


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
    itl_s: float = 0.001  # inter-token latency of a batch of one
    itl_per_seq_s: float = 0.0  # added per running request (decode slows with batch)
    kv_bytes_per_token: int = 57_344  # Qwen2-7B fp16 (56 KiB); sizes tier transfers
    # A CPU engine's steps (``bench.podmodel.PodTiming``; all off by default, as on a
    # GPU): what each other running request adds to a prefill, whether a prefill
    # beside running requests first waits a random share of a step, and the share of
    # the fixed cost a prefill queued behind another pays.
    prefill_s_per_running: float = 0.0
    # What each cached token adds to the prefill behind it (attention reads its keys).
    prefill_s_per_cached_token: float = 0.0
    step_phase_wait: bool = False
    queued_overhead_share: float = 1.0
    decode_waits_for_prefill: bool = False  # PodTiming's: a CPU engine's mixed steps
    # L1: host DRAM, this pod only (vLLM native CPU offloading; medium "CPU").
    l1_capacity_blocks: int = 0  # 0: no L1
    l1_policy: str = "write-through"  # or "evict": offload what L0 evicts
    l1_latency_s: float = 0.001
    l1_bandwidth_bytes_per_s: float = 16e9
    # L2: a directory every pod of the fleet shares (medium "STORAGE", locality "REMOTE").
    l2_dir: Path | None = None  # None: no L2
    l2_capacity_blocks: int = 100_000  # files kept in the directory, whole fleet
    l2_latency_s: float = 0.005
    l2_bandwidth_bytes_per_s: float = 2e9
    # File names are block hashes under this seed, so every pod names a block alike
    # (LMCache needs PYTHONHASHSEED=0 on every pod for the same reason).
    l2_hash_seed: str = "kvgate-l2"
    l2_events: str = "storage"
    pod_name: str = ""  # written into L2 files, to count cross-pod hits
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
    # LoRA adapters served from the start (vLLM's --lora-modules names); more can be
    # loaded at runtime (POST /v1/load_lora_adapter) when runtime updating is allowed,
    # as VLLM_ALLOW_RUNTIME_LORA_UPDATING=True allows it in vLLM.
    lora_modules: tuple[str, ...] = ()
    allow_runtime_lora_updating: bool = False
    max_lora_adapters: int = 64  # adapters registered at once (bounds the sim's state)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.l0_capacity_blocks <= 0:
            raise ValueError("l0_capacity_blocks must be positive")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if min(self.overhead_s, self.itl_s, self.itl_per_seq_s) < 0:
            raise ValueError("timings must not be negative")
        if self.l1_capacity_blocks < 0 or self.l2_capacity_blocks <= 0:
            raise ValueError("l1 capacity must be >= 0 and l2 capacity > 0")
        if self.l1_policy not in L1_POLICIES:
            raise ValueError(f"l1_policy must be one of {L1_POLICIES}")
        if self.l2_events not in L2_EVENT_MODES:
            raise ValueError(f"l2_events must be one of {L2_EVENT_MODES}")
        self.timing()  # validates the tier numbers

    def timing(self) -> PodTiming:
        """The pure timing model these settings describe."""
        return PodTiming(
            overhead_s=self.overhead_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token,
            l1=TierTiming(self.l1_latency_s, self.l1_bandwidth_bytes_per_s),
            l2=TierTiming(self.l2_latency_s, self.l2_bandwidth_bytes_per_s),
            itl_base_s=self.itl_s,
            itl_per_seq_s=self.itl_per_seq_s,
            prefill_s_per_running=self.prefill_s_per_running,
            prefill_s_per_cached_token=self.prefill_s_per_cached_token,
            step_phase_wait=self.step_phase_wait,
            queued_overhead_share=self.queued_overhead_share,
            decode_waits_for_prefill=self.decode_waits_for_prefill,
        )

    def tokenizer_dir(self) -> Path:
        """The tokenizer directory, building the tiny one on first use."""
        if self.tokenizer is not None:
            return Path(self.tokenizer)
        from bench.tinymodel import ensure_tokenizer

        return ensure_tokenizer()
