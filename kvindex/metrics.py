"""Prometheus metrics of KV-event ingestion (decode, sequence tracking, key mapping).

One ``EventMetrics`` per gateway process, built on the registry it is handed (no global
default registry, so tests and several gateways in one process do not collide). Index
size, lookup latency and Redis errors belong to the stores (``kvgate_index_*``:
``kvindex.instrumented.StoreMetrics``).
Labels are bounded: pod ids come from the pod registry, ``type``/``medium`` from fixed
sets (``normalize_medium``), never from event content.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

_MEDIA = {"GPU": "GPU", "CPU": "CPU", "STORAGE": "STORAGE", "DISK": "STORAGE"}
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _label_tuples(metric: object, label: str) -> tuple[int, list[tuple[str, ...]]] | None:
    """Where ``label`` is in ``metric``'s label tuples, and those tuples; None when it has
    no such label. prometheus_client has no public listing of a metric's children, so
    this reads the tuples it keeps."""
    names = getattr(metric, "_labelnames", ())
    children = getattr(metric, "_metrics", None)
    if label not in names or children is None:
        return None
    return names.index(label), list(children)


def forget_label_value(metrics: Iterable[object], label: str, value: str) -> int:
    """Remove every series whose ``label`` is ``value`` (a pod that left the fleet: with
    pods renamed on every rollout, keeping their series would grow without bound);
    returns the number of series removed."""
    removed = 0
    for metric in metrics:
        found = _label_tuples(metric, label)
        if found is None:
            continue
        at, tuples = found
        for labels in [k for k in tuples if k[at] == value]:
            metric.remove(*labels)  # type: ignore[attr-defined]
            removed += 1
    return removed


def label_values(metrics: Iterable[object], label: str) -> set[str]:
    """The values ``label`` has in these metrics' series."""
    values: set[str] = set()
    for metric in metrics:
        found = _label_tuples(metric, label)
        if found is not None:
            at, tuples = found
            values.update(k[at] for k in tuples)
    return values


def normalize_medium(medium: object) -> str:
    """Map an engine medium onto the bounded label set GPU/CPU/STORAGE/none/other."""
    if medium is None:
        return "none"
    if not isinstance(medium, str):
        return "other"
    return _MEDIA.get(medium.upper(), "other")


class EventMetrics:
    """Counters and the lag histogram of the event pipeline."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.events_applied = Counter(
            "kvgate_kv_events_applied_total",
            "KV cache events applied to the index, by event type and engine medium.",
            ["type", "medium", "pod"],
            registry=reg,
        )
        self.decode_errors = Counter(
            "kvgate_kv_event_decode_errors_total",
            "Malformed KV event frames, batches or events (counted and skipped).",
            ["pod"],
            registry=reg,
        )
        self.replays = Counter(
            "kvgate_kv_event_replays_total",
            "Replay requests sent to a pod's replay endpoint after a sequence gap.",
            ["pod"],
            registry=reg,
        )
        self.seq_gaps = Counter(
            "kvgate_kv_event_seq_gaps_total",
            "Sequence gaps seen on a pod's event stream.",
            ["pod"],
            registry=reg,
        )
        self.engine_restarts = Counter(
            "kvgate_kv_engine_restarts_total",
            "Engine restarts detected (sequence went backwards); the pod's L0/L1 was dropped.",
            ["pod"],
            registry=reg,
        )
        self.unknown_hashes = Counter(
            "kvgate_kv_unknown_hashes_total",
            "Engine block hashes that could not be mapped to router keys (skipped).",
            ["pod"],
            registry=reg,
        )
        self.block_size_mismatches = Counter(
            "kvgate_kv_block_size_mismatches_total",
            "BlockStored events whose block size differs from the configured one.",
            ["pod"],
            registry=reg,
        )
        self.event_lag = Histogram(
            "kvgate_kv_event_lag_seconds",
            "Delay between an event batch's engine timestamp and its application.",
            buckets=LAG_BUCKETS,
            registry=reg,
        )

    def forget_pod(self, pod: str) -> None:
        """Drop a departed pod's series."""
        forget_label_value(vars(self).values(), "pod", pod)
