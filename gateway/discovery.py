"""Kubernetes pod discovery: pods matching a label selector join routing when Ready.

List, then watch, as client-go's reflector does: list the namespace's pods by label
selector, reconcile, then watch from the list's ``resourceVersion``. A watch that
ends (the server-side timeout) resumes from the last version seen; ``410 Gone``
(the version fell out of the API server's watch cache) re-lists; any other error
backs off exponentially, with jitter, and resumes. So does a ``410`` again before any
watch has delivered an event or lasted a second, and a watch that ends within a
second without an event (client-go's "very short watch"): a proxy or API server that
does either every time gets a growing pause, not lists and watches back to back.
RBAC: get/list/watch on pods.

Everything a pod contributes is read from the pod object itself: the IP from
``status.podIP``; the HTTP port from the ``kvgate.io/port`` annotation or the
container port named ``http``; the model from the ``kvgate.io/model`` annotation or
label (neither: learned from the pod's ``/v1/models``); vLLM's KV-event endpoints
from the ``kvgate.io/kv-events-port`` and ``kvgate.io/kv-replay-port`` annotations.
A pod is routable while it is Running, Ready and not terminating: a pod given a
``deletionTimestamp`` leaves routing at once, while it still drains its requests.

A malformed pod object (a field of the wrong shape, a ``podIP`` that is not an IP
address, a port outside 1..65535) is counted and skipped; the rest of its list or
watch is applied. Discovery never touches a pod it did not add: a discovered pod
named like a statically configured one is counted (``name_conflict``) and ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import json
import logging
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.config import DiscoverySettings, PodConfig

if TYPE_CHECKING:
    from gateway.pods import Pod, PodRegistry

log = logging.getLogger("kvgate.discovery")

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_EVENT_TYPES = {"ADDED", "MODIFIED", "DELETED", "BOOKMARK"}
# client-go's "very short watch": one that ends this soon without an event is an error
_SHORT_WATCH_S = 1.0
# kvgate_discovery_errors' causes, a fixed vocabulary: gone, short_watch, http_Nxx,
# connection, other (API trouble); bad_object, capacity, name_conflict (pods skipped)


class WatchGone(Exception):
    """The API server no longer holds our resourceVersion: list again."""

    def __init__(self, after_healthy_watch: bool) -> None:
        super().__init__("410 Gone")
        self.after_healthy_watch = after_healthy_watch  # it delivered events or lasted


class ShortWatch(Exception):
    """The watch ended at once without an event: a sick server or proxy, so back off."""


class PodSink(Protocol):
    """Where discovered pods go (the gateway's registry, or a test's list)."""

    async def upsert(self, cfg: PodConfig) -> None: ...

    async def remove(self, name: str) -> None: ...

    def owned_elsewhere(self, name: str) -> bool:
        """True while ``name`` holds a pod this sink did not add (a static one)."""
        ...


def is_routable(pod: Mapping[str, Any]) -> bool:
    """Running, Ready, has an IP and is not being deleted.

    Raises TypeError for a field of the wrong shape (the caller counts and skips it).
    """
    meta = _object(pod, "metadata")
    status = _object(pod, "status")
    if meta.get("deletionTimestamp"):
        return False
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    conditions = _objects(status, "conditions")
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_config(pod: Mapping[str, Any], s: DiscoverySettings) -> PodConfig | None:
    """The routing target a pod object describes; None while it must get no traffic.

    Raises ValueError, KeyError or TypeError for a malformed object (the caller
    counts and skips it).
    """
    if not is_routable(pod):
        return None
    meta = _object(pod, "metadata")
    name = _text(meta, "name")
    if not name:
        raise KeyError("metadata.name")
    annotations = _object(meta, "annotations")
    labels = _object(meta, "labels")
    host = _url_host(_object(pod, "status")["podIP"])
    model = _text(annotations, s.model_annotation) or _text(labels, s.model_label)
    events = _port(annotations.get(s.kv_events_annotation)) or s.kv_events_port
    replay = _port(annotations.get(s.kv_replay_annotation)) or s.kv_replay_port
    return PodConfig(
        name=name,
        url=f"{s.scheme}://{host}:{_http_port(pod, s)}",
        models=[model] if model else [],
        kv_events=f"tcp://{host}:{events}" if events else None,
        kv_replay=f"tcp://{host}:{replay}" if replay and events else None,
        dp_ranks=int(annotations.get(s.dp_ranks_annotation, 1)),
    )


def _object(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``parent[key]`` as a JSON object, {} when absent; TypeError for another shape
    (the API's JSON is trusted for nothing: a string here must not crash the list)."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{key} is a {type(value).__name__}, not an object")
    return value


def _objects(parent: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    """``parent[key]`` as a list of JSON objects, [] when absent; TypeError otherwise."""
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise TypeError(f"{key} is not a list of objects")
    return value


def _text(parent: Mapping[str, Any], key: str) -> str | None:
    """``parent[key]`` as a string, None when absent; TypeError for another type."""
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{key} is a {type(value).__name__}, not a string")
    return value


def _url_host(pod_ip: object) -> str:
    """The pod IP as a URL's host. Anything but a plain IP address is a ValueError: the
    value goes into URLs verbatim, so "evil.example.com/x#" would send traffic there."""
    if not isinstance(pod_ip, str):
        raise TypeError(f"podIP is a {type(pod_ip).__name__}, not a string")
    ip = ipaddress.ip_address(pod_ip)
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        raise ValueError(f"podIP {pod_ip!r} has a zone")  # "%zone" is no part of a URL host
    return f"[{ip}]" if ip.version == 6 else str(ip)  # IPv6 needs brackets in URLs


def _port(value: object) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"port is a {type(value).__name__}")
    port = int(value)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


def _http_port(pod: Mapping[str, Any], s: DiscoverySettings) -> int:
    annotated = _port(_object(_object(pod, "metadata"), "annotations").get(s.port_annotation))
    if annotated is not None:
        return annotated
    for container in _objects(_object(pod, "spec"), "containers"):
        for port in _objects(container, "ports"):
            if port.get("name") == s.port_name:
                return _port(port["containerPort"]) or s.default_port
    return s.default_port


def _pod_name(obj: object) -> str | None:
    """The name of a pod object; None when it is not an object with a named metadata."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) and name else None


async def _pause(backoff: float, ceiling: float) -> float:
    """Sleep a jittered ``backoff``; return the next one (doubled, up to ``ceiling``)."""
    await asyncio.sleep(backoff * (0.5 + random.random() / 2))
    return min(backoff * 2, ceiling)


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
            "Kubernetes API errors, expired and very short watches, and skipped pod objects"
            " (malformed, over capacity, named like a static pod), by cause.",
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
        self._conflicts_logged: set[str] = set()  # bounded: names of static pods only
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
        # A 410 since the last healthy watch: one more means the fresh list's version
        # expires at once too, and relisting at once would only hammer the API server.
        expired_before = False
        while True:
            try:
                if self._api is None:
                    self._api = await _api_client(self._s.kubeconfig)
                if version is None:
                    version = await self._list()
                version = await self._watch(version)
                backoff, expired_before = self._s.backoff_initial_s, False
            except WatchGone as gone:
                self._metrics.errors.labels("gone").inc()
                version = None
                if gone.after_healthy_watch:
                    backoff, expired_before = self._s.backoff_initial_s, False
                if expired_before:
                    log.warning("pod watch expired again at once; listing in %.1fs", backoff)
                    backoff = await _pause(backoff, self._s.backoff_max_s)
                else:
                    log.info("pod watch expired; listing again")
                expired_before = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API down, network, bad kubeconfig: retry, never die
                self._metrics.errors.labels(_cause(exc)).inc()
                log.warning(
                    "pod discovery: %s %s; retrying in %.1fs", type(exc).__name__, exc, backoff
                )
                backoff = await _pause(backoff, self._s.backoff_max_s)

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
        items = pod_list.get("items") if isinstance(pod_list, dict) else None
        if not isinstance(items, list | None):
            raise ValueError("the pod list's items are not a list")  # the whole answer is bad
        seen: dict[str, PodConfig | None] = {}
        for item in items or []:
            self._metrics.events.labels("LIST").inc()
            name = _pod_name(item)
            if name is None:
                self._skip_bad_object("a listed pod without a name")
            else:
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
        started, events = time.monotonic(), 0
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
                    events += 1
                    version = await self._apply(event, version)
        except ApiException as exc:
            if exc.status == 410:
                healthy = events > 0 or time.monotonic() - started >= _SHORT_WATCH_S
                raise WatchGone(after_healthy_watch=healthy) from exc
            raise
        if events == 0 and time.monotonic() - started < _SHORT_WATCH_S:
            raise ShortWatch("the pod watch ended at once without an event")
        return version

    async def _apply(self, event: object, version: str) -> str:
        if not isinstance(event, Mapping):  # a line that was not JSON comes as text
            self._skip_bad_object("a watch event that is not an object")
            return version
        kind = str(event.get("type"))
        obj = event.get("raw_object")
        self._metrics.events.labels(kind if kind in _EVENT_TYPES else "other").inc()
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        if not isinstance(meta, Mapping):
            self._skip_bad_object(f"a {kind} event without an object's metadata")
            return version
        resource_version = meta.get("resourceVersion")
        if isinstance(resource_version, str) and resource_version:
            version = resource_version
        if kind == "BOOKMARK":
            return version
        name = _pod_name(obj)
        if name is None:
            self._skip_bad_object(f"a {kind} event for a pod without a name")
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
            self._skip_bad_object(repr(exc))
            return None

    def _skip_bad_object(self, why: str) -> None:
        self._metrics.errors.labels("bad_object").inc()
        log.warning("skipping pod object: %s", why)

    async def _upsert(self, cfg: PodConfig) -> None:
        if self._sink.owned_elsewhere(cfg.name):
            self._refuse_conflict(cfg.name)
            return
        if self.members.get(cfg.name) == cfg:
            return
        if cfg.name not in self.members and len(self.members) >= self._s.max_pods:
            self._metrics.errors.labels("capacity").inc()
            return
        self.members[cfg.name] = cfg
        self._metrics.pods.set(len(self.members))
        log.info("pod %s routable at %s", cfg.name, cfg.url)
        await self._sink.upsert(cfg)

    def _refuse_conflict(self, name: str) -> None:
        """A discovered pod named like one discovery did not add (a static pod, whose
        URL and keys the operator chose): it keeps the name; discovery lets go of it."""
        self._metrics.errors.labels("name_conflict").inc()
        if self.members.pop(name, None) is not None:  # a reload made it static since
            self._metrics.pods.set(len(self.members))
        if name not in self._conflicts_logged:
            self._conflicts_logged.add(name)
            log.warning("discovered pod %s is named like a configured pod; ignoring it", name)

    async def _remove(self, name: str) -> None:
        self.members.pop(name, None)
        self._metrics.pods.set(len(self.members))
        if self._sink.owned_elsewhere(name):
            return  # the name is a static pod's now: its deletion is not ours to apply
        log.info("pod %s left routing", name)
        await self._sink.remove(name)


class RegistrySink:
    """Discovery applied to a gateway's pod registry (whose listeners tell the KV index).

    It remembers the pods it added, so that discovery can tell them from the pods
    configured statically (``settings.pods``), which it must never replace or remove.
    """

    def __init__(self, registry: PodRegistry) -> None:
        self._registry = registry
        self._added: dict[str, Pod] = {}

    def owned_elsewhere(self, name: str) -> bool:
        held = self._registry.get(name)
        if held is None or held is self._added.get(name):
            return False
        self._added.pop(name, None)  # replaced by a reload's static pod: no longer ours
        return True

    async def upsert(self, cfg: PodConfig) -> None:
        old = self._registry.get(cfg.name)
        if old is not None:
            if old.config == cfg:
                return
            await self.remove(cfg.name)  # new address or endpoints: a new pod to routing
        pod = self._registry.add(cfg)
        self._added[cfg.name] = pod
        await self._registry.probe(pod)  # first contact admits it at once

    async def remove(self, name: str) -> None:
        self._added.pop(name, None)
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
    if isinstance(exc, ShortWatch):
        return "short_watch"
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status > 0:
        return f"http_{status // 100}xx"
    return "connection" if isinstance(exc, OSError | asyncio.TimeoutError) else "other"
