"""deploy/: every manifest is a valid Kubernetes object and says what the docs promise.

Kinds Kubernetes defines are validated (strict) against the schemas that ship inside
the ``kubernetes-validate`` package (offline). Custom resources we do not own
(ServiceMonitor, InferenceEndpointConfig) and CSI StorageClass parameters are checked
for well-formed YAML and their required fields. Kustomizations are resolved here
(resources and patches, recursively) and, where ``kubectl`` is installed, built with
``kubectl kustomize`` and the output validated too.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import Settings, SettingsSource, load_settings
from kvindex.memory_store import KEY_BYTES

DEPLOY = Path(__file__).parents[2] / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.31.0"
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("inference.sagemaker.aws.amazon.com/v1", "InferenceEndpointConfig"),
}


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def resolve(directory: Path) -> tuple[list[Path], list[Path]]:
    """(resource files, patch files) a kustomization pulls in, following directories."""
    k = kustomization(directory)
    files: list[Path] = []
    patches = [(directory / p["path"]).resolve() for p in k.get("patches", [])]
    for entry in k.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            sub_files, sub_patches = resolve(target)
            files += sub_files
            patches += sub_patches
        else:
            assert target.is_file(), f"{directory}: missing resource {entry}"
            files.append(target)
    for gen in k.get("configMapGenerator", []):
        for f in gen.get("files", []):
            assert (directory / f).is_file(), f"{directory}: missing generator file {f}"
    return files, patches


@functools.cache
def all_objects() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name != "kustomization.yaml" and path not in patch_files():
            out += [(path, doc) for doc in load_docs(path)]
    return out


@functools.cache
def patch_files() -> frozenset[Path]:
    found: set[Path] = set()
    for overlay in OVERLAYS:
        found |= set(resolve(DEPLOY / "overlays" / overlay)[1])
    return frozenset(found)


def find(kind: str, name: str, objects: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    pool = objects if objects is not None else [doc for _, doc in all_objects()]
    matches = [d for d in pool if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    )


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_builtin_kind_validates_strictly_against_the_kubernetes_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = all_objects()
    assert len(objects) >= 15
    for path, doc in objects:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(DEPLOY)} {doc['kind']}: {exc.message}")


def test_every_manifest_is_used_by_some_overlay():
    used: set[Path] = set()
    for overlay in OVERLAYS:
        files, patches = resolve(DEPLOY / "overlays" / overlay)
        used |= set(files) | set(patches)
    on_disk = {p.resolve() for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk - used == set()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_with_kubectl_kustomize_and_output_validates(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (its built-in kustomize builds the overlays)")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        if doc["kind"] != "Namespace" and (doc["kind"], doc["apiVersion"]) != (
            "StorageClass",
            "storage.k8s.io/v1",
        ):
            assert doc["metadata"]["namespace"] == "inference", doc["metadata"]["name"]
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = sorted({d["kind"] for d in docs})
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"} <= set(kinds)


def test_service_monitor_has_its_required_fields_and_scrapes_the_kvgate_service():
    sm = find("ServiceMonitor", "kvgate")
    service = find("Service", "kvgate", load_docs(DEPLOY / "kvgate/gateway/service.yaml"))
    assert sm["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics")]
    assert service["spec"]["ports"][0]["name"] == "http"


def test_hyperpod_endpoint_has_required_fields_and_the_l2_override():
    iec = find("InferenceEndpointConfig", "qwen2-7b")
    spec = iec["spec"]
    for field in ("modelName", "instanceType", "modelSourceConfig", "worker"):
        assert field in spec, field
    assert spec["kvCacheSpec"] == {
        "enableL1Cache": True,
        "enableL2Cache": True,
        "l2CacheSpec": {"l2CacheBackend": "tieredstorage"},
    }
    assert spec["intelligentRoutingSpec"]["routingStrategy"] in {
        "prefixaware",
        "kvaware",
        "roundrobin",
        "session",
    }
    env = {e["name"]: e["value"] for e in spec["worker"]["environmentVariables"]}
    assert env["PYTHONHASHSEED"] == "0"
    assert env["LMCACHE_CHUNK_SIZE"] == "256"
    assert env["LMCACHE_REMOTE_URL"] == "fs://localhost:0/mnt/kv-l2/lmcache"


def test_curvine_storage_class_and_claim_give_a_shared_read_write_many_l2():
    sc = find("StorageClass", "curvine-kv")
    pvc = find("PersistentVolumeClaim", "kv-l2")
    assert sc["provisioner"] == "curvine"
    assert {"master-addrs", "fs-path"} <= set(sc["parameters"])
    assert all(":" in a for a in sc["parameters"]["master-addrs"].split(","))
    assert pvc["spec"]["storageClassName"] == "curvine-kv"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_native_vllm_publishes_events_and_tiers_l1_memory_and_remote_l2_on_the_pvc():
    vllm = find("Deployment", "vllm", load_docs(DEPLOY / "vllm/native/deployment.yaml"))
    args = container(vllm, "vllm")["args"]
    assert "--enable-prefix-caching" in args
    assert json.loads(flag(args, "--kv-events-config")) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv-events",
    }
    transfer = json.loads(flag(args, "--kv-transfer-config"))
    extra = transfer["kv_connector_extra_config"]
    assert (transfer["kv_connector"], extra["spec_name"]) == (
        "OffloadingConnector",
        "TieringOffloadingSpec",
    )
    assert extra["cpu_bytes_to_use"] == 64 * 2**30
    [tier] = extra["secondary_tiers"]
    assert (tier["type"], tier["locality"], tier["root_dir"]) == ("fs", "REMOTE", "/mnt/kv-l2/vllm")
    mounts = {m["name"]: m["mountPath"] for m in container(vllm, "vllm")["volumeMounts"]}
    assert mounts["kv-l2"] == "/mnt/kv-l2"


def test_lmcache_vllm_uses_256_token_chunks_fs_l2_on_the_pvc_and_a_fixed_hash_seed():
    vllm = find("Deployment", "vllm", load_docs(DEPLOY / "vllm/lmcache/deployment.yaml"))
    c = container(vllm, "vllm")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PYTHONHASHSEED"] == "0"
    cm = find("ConfigMap", "lmcache-config")
    config = yaml.safe_load(cm["data"]["lmcache.yaml"])
    assert config["chunk_size"] == 256
    assert config["remote_url"] == "fs://localhost:0/mnt/kv-l2/lmcache"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert config["remote_url"].startswith(f"fs://localhost:0{mounts['kv-l2']}/")
    assert env["LMCACHE_CONFIG_FILE"] == f"{mounts['lmcache-config']}/lmcache.yaml"
    assert json.loads(flag(c["args"], "--kv-transfer-config"))["kv_connector"] == (
        "LMCacheConnectorV1"
    )


@pytest.mark.parametrize("variant", ["native", "lmcache"])
def test_vllm_pods_carry_the_labels_and_annotations_discovery_reads(variant):
    vllm = find("Deployment", "vllm", load_docs(DEPLOY / f"vllm/{variant}/deployment.yaml"))
    meta = vllm["spec"]["template"]["metadata"]
    assert meta["labels"]["kvgate.io/pool"] == "default"
    assert meta["labels"]["kvgate.io/model"] == "qwen2-7b"
    ports = {p["name"]: p["containerPort"] for p in container(vllm, "vllm")["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    assert meta["annotations"] == {
        "kvgate.io/kv-events-port": "5557",
        "kvgate.io/kv-replay-port": "5558",
    }


def test_redis_keeps_nothing_on_disk_and_evicts_lru_under_a_memory_cap():
    redis = find("Deployment", "kvgate-redis")
    args = container(redis, "redis")["args"]
    assert flag(args, "--save") == ""
    assert flag(args, "--appendonly") == "no"
    assert flag(args, "--maxmemory") == "3gb"
    assert flag(args, "--maxmemory-policy") == "allkeys-lru"


def test_kvgate_config_map_and_env_load_as_gateway_settings(tmp_path, monkeypatch):
    cm = find("ConfigMap", "kvgate-config")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    gw = find("Deployment", "kvgate")
    assert gw["spec"]["replicas"] >= 2
    for env in container(gw, "kvgate")["env"]:
        monkeypatch.setenv(env["name"], env["value"])
    settings = load_settings(path)
    assert (settings.index.backend, settings.index.redis_url) == (
        "redis",
        "redis://kvgate-redis:6379/0",
    )
    assert settings.discovery.enabled is True
    assert settings.discovery.label_selector == "kvgate.io/pool=default"
    assert settings.strategy == "kv-aware"
    assert settings.models["qwen2-7b"].block_size == 16


def test_a_kvgate_pod_keeps_serving_until_its_endpoints_are_gone_then_drains():
    """A rollout or scale-down must not refuse requests: a preStop sleep keeps the
    listener open while the endpoints change (SIGTERM closes it at once:
    tests/integration/test_gateway_lifecycle.py), then streams in flight may finish."""
    vllm_with_sidecar = load_docs(DEPLOY / "overlays/sidecar/vllm-with-kvgate.yaml")[0]
    for deployment in (find("Deployment", "kvgate"), vllm_with_sidecar):
        pre_stop = container(deployment, "kvgate")["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep" and 3 <= int(pre_stop[1]) <= 15
    gw = find("Deployment", "kvgate")["spec"]["template"]["spec"]
    vllm = load_docs(DEPLOY / "vllm/native/deployment.yaml")[0]["spec"]["template"]["spec"]
    assert gw["terminationGracePeriodSeconds"] >= 120
    assert vllm["terminationGracePeriodSeconds"] >= 120  # the sidecar's pod


# What a worker holds beside its index: the interpreter and libraries (~70 MB at
# start), the tokenizer and keyer caches and the other bounded structures of
# docs/deploy.md's worst-case table, rounded up.
WORKER_BASE_BYTES = 200 * 2**20


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_every_kvgate_container_fits_its_workers_full_indexes_in_its_memory_limit(tmp_path):
    """Each worker keeps a whole index (with Redis, the fallback view), up to
    index.capacity_keys x KEY_BYTES: workers x (that + a worker's base) must fit the
    limit, or a busy fleet fills the indexes until the container is OOM-killed."""
    cm = find("ConfigMap", "kvgate-config")["data"]["config.yaml"]
    vllm_with_sidecar = load_docs(DEPLOY / "overlays/sidecar/vllm-with-kvgate.yaml")[0]
    for deployment in (find("Deployment", "kvgate"), vllm_with_sidecar):
        kvgate = container(deployment, "kvgate")
        env = {e["name"]: e["value"] for e in kvgate.get("env", []) if "value" in e}
        settings = Settings(**{**yaml.safe_load(cm), **_env_overrides(env)})
        index = settings.index.capacity_keys * KEY_BYTES
        needed = settings.workers * (index + WORKER_BASE_BYTES)
        limit = _bytes(kvgate["resources"]["limits"]["memory"])
        name = deployment["metadata"]["name"]
        assert needed <= limit, f"{name}: {settings.workers} workers need {needed >> 20} MiB"
        cpu = kvgate["resources"]["requests"]["cpu"]
        cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        assert settings.workers <= max(1, round(cores)), f"{name}: more workers than CPUs"


def _env_overrides(env: dict[str, str]) -> dict[str, Any]:
    return {"workers": int(env["KVGATE_WORKERS"])} if "KVGATE_WORKERS" in env else {}


def service_links(services: list[dict[str, Any]]) -> dict[str, str]:
    """The variables the kubelet gives every container for these Services (its Docker
    links, kubelet/envvars: the Service's name upper-cased, "-" as "_")."""
    env: dict[str, str] = {}
    for number, service in enumerate(services):
        name = service["metadata"]["name"].upper().replace("-", "_")
        ip = f"10.96.0.{number + 10}"
        ports = service["spec"]["ports"]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            proto = port.get("protocol", "TCP")
            if "name" in port:  # SERVICE_PORT_<port name>
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(
                    port["port"]
                )
            link = f"{name}_PORT_{port['port']}_{proto}"
            env[link] = f"{proto.lower()}://{ip}:{port['port']}"
            env[f"{link}_PROTO"] = proto.lower()
            env[f"{link}_PORT"] = str(port["port"])
            env[f"{link}_ADDR"] = ip
        env[f"{name}_PORT"] = env[
            f"{name}_PORT_{ports[0]['port']}_{ports[0].get('protocol', 'TCP')}"
        ]
    return env


def test_the_gateway_starts_beside_the_service_links_of_every_service_shipped(
    tmp_path, monkeypatch
):
    """A Service named kvgate makes the kubelet set KVGATE_PORT=tcp://<ip>:80 in every pod
    of its namespace, where it is also the name of the port setting: read as the setting
    it stopped the gateway at start. Our Deployment also turns the links off."""
    services = {d["metadata"]["name"]: d for _, d in all_objects() if d["kind"] == "Service"}
    links = service_links(list(services.values()))
    assert links["KVGATE_PORT"].startswith("tcp://") and links["KVGATE_PORT"].endswith(":80")
    assert "KVGATE_REDIS_PORT_6379_TCP_ADDR" in links
    for name, value in links.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "config.yaml"
    path.write_text(find("ConfigMap", "kvgate-config")["data"]["config.yaml"])
    assert SettingsSource(path).load().port == 8000  # the file's, not the link's
    monkeypatch.setenv("KVGATE_PORT", "9000")  # a setting given as such still wins
    assert SettingsSource(path).load().port == 9000
    gw = find("Deployment", "kvgate")
    assert gw["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_kvgate_rbac_grants_only_reading_pods():
    role = find("Role", "kvgate-pod-reader")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = find("RoleBinding", "kvgate-pod-reader")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvgate"}]
    gw = find("Deployment", "kvgate")
    assert gw["spec"]["template"]["spec"]["serviceAccountName"] == "kvgate"
