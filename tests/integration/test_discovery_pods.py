"""What discovery reads from a pod object (pure), and that the recorded pods are real Pods."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.config import DiscoverySettings, PodConfig
from gateway.discovery import is_routable, pod_config

CONVERSATION = Path(__file__).parents[1] / "data" / "k8s" / "conversation.jsonl"
SETTINGS = DiscoverySettings(enabled=True)


def recorded_pods() -> list[dict[str, Any]]:
    """Every pod object in the recorded conversation, with kind/apiVersion restored."""
    pods = []
    for line in CONVERSATION.read_text().splitlines():
        step = json.loads(line)
        if step.get("body", {}).get("kind") == "PodList":
            pods += [{"kind": "Pod", "apiVersion": "v1", **p} for p in step["body"]["items"]]
        obj = step.get("send", {}).get("object", {})
        if obj.get("kind") == "Pod" and "spec" in obj:
            pods.append(obj)
    return pods


def ready_pod() -> dict[str, Any]:
    first = json.loads(CONVERSATION.read_text().splitlines()[0])
    return copy.deepcopy(first["body"]["items"][0])


def test_recorded_pods_validate_against_the_kubernetes_pod_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    pods = recorded_pods()
    assert len(pods) == 8
    for pod in pods:
        kubernetes_validate.validate(pod, "1.31.0", strict=True)


def test_ready_pod_becomes_a_pod_config_from_ip_named_port_label_and_annotations():
    assert pod_config(ready_pod(), SETTINGS) == PodConfig(
        name="vllm-5f7c9d8b6-2xkqp",
        url="http://10.0.12.34:8000",
        models=["kvgate-tiny-llama"],
        kv_events="tcp://10.0.12.34:5557",
        kv_replay="tcp://10.0.12.34:5558",
    )


def test_port_annotation_wins_over_the_named_port_and_model_annotation_over_the_label():
    pod = ready_pod()
    pod["metadata"]["annotations"] |= {"kvgate.io/port": "9000", "kvgate.io/model": "Qwen/Qwen2-7B"}
    cfg = pod_config(pod, SETTINGS)
    assert cfg is not None
    assert (cfg.url, cfg.models) == ("http://10.0.12.34:9000", ["Qwen/Qwen2-7B"])


def test_pod_without_http_port_or_model_uses_default_port_and_learns_models():
    pod = ready_pod()
    pod["spec"]["containers"][0]["ports"] = []
    del pod["metadata"]["labels"]["kvgate.io/model"]
    del pod["metadata"]["annotations"]["kvgate.io/kv-events-port"]
    cfg = pod_config(pod, SETTINGS)
    assert cfg is not None
    assert (cfg.url, cfg.models, cfg.kv_events, cfg.kv_replay) == (
        "http://10.0.12.34:8000",
        [],
        None,
        None,
    )


def test_ipv6_pod_ip_is_bracketed_in_urls():
    pod = ready_pod()
    pod["status"]["podIP"] = "fd00:10:244::5"
    cfg = pod_config(pod, SETTINGS)
    assert cfg is not None
    assert (cfg.url, cfg.kv_events) == (
        "http://[fd00:10:244::5]:8000",
        "tcp://[fd00:10:244::5]:5557",
    )


@pytest.mark.parametrize(
    "change",
    ["not_ready", "terminating", "pending", "no_ip"],
)
def test_pods_that_must_not_get_traffic_are_not_routable(change):
    pod = ready_pod()
    if change == "not_ready":
        pod["status"]["conditions"][2]["status"] = "False"
    elif change == "terminating":
        pod["metadata"]["deletionTimestamp"] = "2025-06-02T10:02:55Z"
    elif change == "pending":
        pod["status"]["phase"] = "Pending"
    else:
        del pod["status"]["podIP"]
    assert is_routable(pod) is False
    assert pod_config(pod, SETTINGS) is None


@pytest.mark.parametrize("value", ["http", "0", "70000"])
def test_bad_port_annotation_is_an_error_for_the_caller_to_count(value):
    pod = ready_pod()
    pod["metadata"]["annotations"]["kvgate.io/kv-events-port"] = value
    with pytest.raises(ValueError):
        pod_config(pod, SETTINGS)


@pytest.mark.parametrize(
    "pod_ip", ["evil.example.com/x#", "10.0.12.34:9000", "10.0.12.34/x", "fe80::1%eth0", 167772161]
)
def test_pod_ip_that_is_not_a_plain_ip_address_is_an_error_not_a_url_host(pod_ip):
    """The IP goes into URLs verbatim: "evil.example.com/x#" made http://evil.example.com/x#:8000."""
    pod = ready_pod()
    pod["status"]["podIP"] = pod_ip
    with pytest.raises((ValueError, TypeError)):
        pod_config(pod, SETTINGS)


@pytest.mark.parametrize("container_port", [0, 99999, True])
def test_bad_named_container_port_is_an_error_for_the_caller_to_count(container_port):
    pod = ready_pod()
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = container_port
    with pytest.raises((ValueError, TypeError)):
        pod_config(pod, SETTINGS)


@pytest.mark.parametrize(
    "field",
    ["metadata", "metadata.annotations", "metadata.labels", "status", "spec", "spec.containers"],
)
def test_a_field_of_the_wrong_shape_is_a_type_error_for_the_caller_to_count(field):
    """Not an AttributeError from deep inside, which the caller would not expect."""
    pod = ready_pod()
    *parents, key = field.split(".")
    parent = pod
    for part in parents:
        parent = parent[part]
    parent[key] = ["x"]
    with pytest.raises(TypeError):
        pod_config(pod, SETTINGS)
