"""With ``--workers`` /metrics reads the workers' files, where prometheus_client cannot
remove a label set: ``FleetSeries`` exposes only the series of the fleet's pods and
models, so a rollout's departed pods and an unloaded adapter's series do not pile up."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from gateway.metrics import FleetSeries


def test_only_the_fleets_pods_and_models_are_exposed():
    files = CollectorRegistry()  # stands in for the workers' files: same families
    requests = Counter("kvgate_requests", "r", ["pod", "model"], registry=files)
    healthy = Counter("kvgate_probe", "p", ["pod"], registry=files)
    refused = Counter("kvgate_refused", "n", ["bound"], registry=files)
    for pod in ("pod-now", "pod-gone", ""):
        for model in ("base", "adapter-gone", ""):
            requests.labels(pod, model).inc()
        healthy.labels(pod).inc()
    refused.labels("client_connections").inc()
    gone_only = Counter("kvgate_gone_only", "g", ["pod"], registry=files)
    gone_only.labels("pod-gone").inc()

    exposition = CollectorRegistry()
    exposition.register(FleetSeries(files, lambda: ["pod-now"], lambda: {"base"}))
    text = generate_latest(exposition).decode()

    lines = {line.split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert {line for line in lines if line.startswith("kvgate_requests_total")} == {
        f'kvgate_requests_total{{model="{m}",pod="{p}"}}'
        for p in ("pod-now", "")
        for m in ("base", "")
    }
    assert 'kvgate_probe_total{pod="pod-now"}' in lines and 'kvgate_probe_total{pod=""}' in lines
    assert 'kvgate_refused_total{bound="client_connections"}' in lines  # no pod, no model
    assert "gone" not in text.replace("kvgate_gone_only", "")  # no departed pod or model
    assert "kvgate_gone_only_total" not in text  # a family left with no series is left out
