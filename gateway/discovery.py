"""Kubernetes pod discovery: pods matching a label selector join routing when Ready.

List, then watch, as client-go's reflector does: list the namespace's pods by label
selector, reconcile, then watch from the list's ``resourceVersion``. A watch that
ends (the server-side timeout) resumes from the last version seen; ``410 Gone``
(the version fell out of the API server's watch cache) re-lists; any other error
backs off exponentially, with jitter, and resumes. RBAC: get/list/watch on pods.

Everything a pod contributes is read from the pod object itself: the IP from
``status.podIP``; the HTTP port from the ``kvgate.io/port`` annotation or the
container port named ``http``; the model from the ``kvgate.io/model`` annotation or
label (neither: learned from the pod's ``/v1/models``); vLLM's KV-event endpoints
from the ``kvgate.io/kv-events-port`` and ``kvgate.io/kv-replay-port`` annotations.
A pod is routable while it is Running, Ready and not terminating: a pod given a
``deletionTimestamp`` leaves routing at once, while it still drains its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.config import DiscoverySettings, PodConfig

if TYPE_CHECKING:
    from gateway.pods import PodRegistry

log = logging.getLogger("kvgate.discovery")

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_EVENT_TYPES = {"ADDED", "MODIFIED", "DELETED", "BOOKMARK"}


class WatchGone(Exception):
    """The API server no longer holds our resourceVersion: list again."""


class PodSink(Protocol):
    """Where discovered pods go (the gateway's registry, or a test's list)."""

    async def upsert(self, cfg: PodConfig) -> None: ...

    async def remove(self, name: str) -> None: ...


def is_routable(pod: Mapping[str, Any]) -> bool:
    """Running, Ready, has an IP and is not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return False
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_config(pod: Mapping[str, Any], s: DiscoverySettings) -> PodConfig | None:
    """The routing target a pod object describes; None while it must get no traffic.

    Raises ValueError, KeyError or TypeError for a malformed object (the caller
    counts and skips it).
    """
    if not is_routable(pod):
        return None
    meta = pod["metadata"]
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    ip = str(pod["status"]["podIP"])
    host = f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs need brackets in URLs
    model = annotations.get(s.model_annotation) or labels.get(s.model_label)
    events = _port(annotations.get(s.kv_events_annotation)) or s.kv_events_port
    replay = _port(annotations.get(s.kv_replay_annotation)) or s.kv_replay_port
    return PodConfig(
        name=str(meta["name"]),
        url=f"{s.scheme}://{host}:{_http_port(pod, s)}",
        models=[model] if model else [],
        kv_events=f"tcp://{host}:{events}" if events else None,
        kv_replay=f"tcp://{host}:{replay}" if replay and events else None,
        dp_ranks=int(annotations.get(s.dp_ranks_annotation, 1)),
    )


def _port(value: object) -> int | None:
    if value is None or value == "":
        return None
    port = int(str(value))
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


def _http_port(pod: Mapping[str, Any], s: DiscoverySettings) -> int:
    annotated = _port((pod["metadata"].get("annotations") or {}).get(s.port_annotation))
    if annotated is not None:
        return annotated
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == s.port_name:
                return int(port["containerPort"])
    return s.default_port


class DiscoveryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "kvgate_discovery_events",
            "Pod list/watch events applied (LIST counts pods seen in a full list).",
            ["type"],
            registry=registry,
        )
        self.errors = Counter(
            "kvgate_discovery_errors",
            "Kubernetes API errors, expired watches and skipped pod objects, by cause.",
            ["cause"],
            registry=registry,
        )
        self.pods = Gauge(
            "kvgate_discovery_pods",
            "Discovered pods that are routable now.",
            registry=registry,
            multiprocess_mode="livemax",
        )


class PodDiscovery:
    """Keeps ``sink`` equal to the set of routable pods the Kubernetes API reports."""

    def __init__(
        self, settings: DiscoverySettings, sink: PodSink, metrics: DiscoveryMetrics
    ) -> None:
        self._s = settings
        self._sink = sink
        self._metrics = metrics
        self.members: dict[str, PodConfig] = {}
        self._api: Any = None  # kubernetes_asyncio ApiClient, built in the task
        self._task: asyncio.Task[None] | None = None
        self.namespace = settings.namespace or _own_namespace()

    async def start(self) -> None:
        require_kubernetes_client()
        self._task = asyncio.create_task(self._run(), name="kvgate-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._api is not None:
            await self._api.close()

    async def _run(self) -> None:
        backoff = self._s.backoff_initial_s
        version: str | None = None
        while True:
            try:
                if self._api is None:
                    self._api = await _api_client(self._s.kubeconfig)
                if version is None:
                    version = await self._list()
                version = await self._watch(version)
                backoff = self._s.backoff_initial_s
            except WatchGone:
                self._metrics.errors.labels("gone").inc()
                log.info("pod watch expired; listing again")
                version = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API down, network, bad kubeconfig: retry, never die
                self._metrics.errors.labels(_cause(exc)).inc()
                log.warning(
                    "pod discovery: %s %s; retrying in %.1fs", type(exc).__name__, exc, backoff
                )
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self._s.backoff_max_s)

    async def _list(self) -> str:
        """One full list; reconcile members with it; return its resourceVersion."""
        from kubernetes_asyncio.client import ApiException, CoreV1Api

        resp = await CoreV1Api(self._api).list_namespaced_pod(
            self.namespace,
            label_selector=self._s.label_selector,
            _preload_content=False,
            _request_timeout=(5, 60),
        )
        body = await resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=body[:200].decode(errors="replace"))
        pod_list = json.loads(body)
        seen: dict[str, PodConfig | None] = {}
        for item in pod_list.get("items") or []:
            self._metrics.events.labels("LIST").inc()
            name = (item.get("metadata") or {}).get("name")
            if isinstance(name, str):
                seen[name] = self._describe(item)
        gone = [n for n in self.members if seen.get(n) is None]
        await asyncio.gather(*(self._remove(n) for n in gone))
        await asyncio.gather(*(self._upsert(c) for c in seen.values() if c is not None))
        return str(pod_list["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        """Apply watch events until the server ends the stream; return the last version."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client import ApiException, CoreV1Api

        timeout = self._s.watch_timeout_s
        stream = watch.Watch(return_type="object").stream(
            CoreV1Api(self._api).list_namespaced_pod,
            self.namespace,
            label_selector=self._s.label_selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=(5, timeout + 30),  # a silent dead connection ends too
        )
        try:
            async with stream:
                async for event in stream:
                    version = await self._apply(event, version)
        except ApiException as exc:
            if exc.status == 410:
                raise WatchGone from exc
            raise
        return version

    async def _apply(self, event: Mapping[str, Any], version: str) -> str:
        kind = str(event.get("type"))
        obj = event.get("raw_object")
        self._metrics.events.labels(kind if kind in _EVENT_TYPES else "other").inc()
        if not isinstance(obj, dict):
            self._metrics.errors.labels("bad_object").inc()
            return version
        meta = obj.get("metadata") or {}
        version = str(meta.get("resourceVersion") or version)
        name = meta.get("name")
        if kind == "BOOKMARK" or not isinstance(name, str):
            return version
        cfg = None if kind == "DELETED" else self._describe(obj)
        if cfg is None:
            if name in self.members:
                await self._remove(name)
        else:
            await self._upsert(cfg)
        return version

    def _describe(self, obj: Mapping[str, Any]) -> PodConfig | None:
        try:
            return pod_config(obj, self._s)
        except (ValueError, KeyError, TypeError) as exc:
            self._metrics.errors.labels("bad_object").inc()
            log.warning("skipping pod object: %r", exc)
            return None

    async def _upsert(self, cfg: PodConfig) -> None:
        if self.members.get(cfg.name) == cfg:
            return
        if cfg.name not in self.members and len(self.members) >= self._s.max_pods:
            self._metrics.errors.labels("capacity").inc()
            return
        self.members[cfg.name] = cfg
        self._metrics.pods.set(len(self.members))
        log.info("pod %s routable at %s", cfg.name, cfg.url)
        await self._sink.upsert(cfg)

    async def _remove(self, name: str) -> None:
        self.members.pop(name, None)
        self._metrics.pods.set(len(self.members))
        log.info("pod %s left routing", name)
        await self._sink.remove(name)


class RegistrySink:
    """Discovery applied to a gateway's pod registry (whose listeners tell the KV index)."""

    def __init__(self, registry: PodRegistry) -> None:
        self._registry = registry

    async def upsert(self, cfg: PodConfig) -> None:
        old = self._registry.get(cfg.name)
        if old is not None:
            if old.config == cfg:
                return
            await self.remove(cfg.name)  # new address or endpoints: a new pod to routing
        pod = self._registry.add(cfg)
        await self._registry.probe(pod)  # first contact admits it at once

    async def remove(self, name: str) -> None:
        await self._registry.remove(name)


def require_kubernetes_client() -> None:
    """Fail at start-up, saying what to install, when the ``k8s`` extra is missing."""
    if importlib.util.find_spec("kubernetes_asyncio") is None:
        raise RuntimeError(
            "discovery.enabled needs the Kubernetes client: pip install 'kvgate[k8s]' "
            "(the container image: docker build --build-arg EXTRAS=k8s)"
        )


async def _api_client(kubeconfig: str | None) -> Any:
    """In-cluster service account unless a kubeconfig is named; else ~/.kube/config."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            await config.load_kube_config(client_configuration=cfg)
    return client.ApiClient(configuration=cfg)


def _own_namespace() -> str:
    with contextlib.suppress(OSError):
        return _SA_NAMESPACE.read_text().strip() or "default"
    return "default"


def _cause(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status > 0:
        return f"http_{status // 100}xx"
    return "connection" if isinstance(exc, OSError | asyncio.TimeoutError) else "other"
