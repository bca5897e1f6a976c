"""vLLM's Prometheus metrics, same names, labels, help text and buckets (v0.32).

Source: ``vllm/v1/metrics/loggers.py`` (labels ``model_name`` and ``engine``)
and ``vllm/v1/metrics/buckets.py``. One ``CollectorRegistry`` per app, so many
simulated pods can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_LABELS = ("model_name", "engine")


class SimMetrics:
    """The metric children of one engine, bound to their label values."""

    def __init__(
        self,
        model: str,
        engine: int,
        block_size: int,
        num_gpu_blocks: int,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        lv = (model, str(engine))

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, _LABELS, registry=reg).labels(*lv).set_function(fn)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=reg).labels(*lv)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=reg, buckets=buckets).labels(*lv)

        gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", running
        )
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        # KV connector (offloading) lookups: tokens the local cache did not cover, and
        # the part of them the connector served (vLLM 0.32 ``connector_prefix_cache_stats``).
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            (*_LABELS, "source"),
            registry=reg,
        )
        self.by_source = {src: by_source.labels(*lv, src) for src in PROMPT_SOURCES}
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*_LABELS, "finished_reason"),
            registry=reg,
        )
        self.request_success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "engine", "num_gpu_blocks",
             "prefix_caching_hash_algo"),
            registry=reg,
        )  # fmt: skip
        info.labels(str(block_size), "True", str(engine), str(num_gpu_blocks), "sha256").set(1)
        # vLLM's API server registry carries prometheus_client's process collector; its
        # start time is how a gateway tells a restarted pod from one that kept its cache.
        Gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            registry=reg,
        ).set(time.time())

    def render(self) -> bytes:
        return generate_latest(self.registry)
