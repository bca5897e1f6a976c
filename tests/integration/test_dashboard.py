"""The Grafana dashboard asks only for metrics a live gateway exports, in valid PromQL.

A real gateway runs with every optional metric family switched on (Redis index, KV
events from simulated pods, pod discovery) and serves a few requests; its /metrics
exposition is the source of truth for names. Histogram series (``_bucket``, ``_sum``,
``_count``) and counter series (``_total``) are derived from each family's TYPE line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from bench.gateway_proc import free_port, run_gateway
from bench.sim.launch import sim_fleet

DASHBOARD = Path(__file__).parents[2] / "deploy" / "monitoring" / "grafana-dashboard.json"
NAME = re.compile(r"\bkvgate_[a-z0-9_]+")
# What the dashboard must show (issue 6): routing decisions, hit tiers, TTFT, pod
# health, index size, event lag.
REQUIRED = {
    "kvgate_routing_decisions_total",
    "kvgate_kv_events_applied_total",
    "kvgate_prompt_tokens_total",
    "kvgate_ttft_seconds_bucket",
    "kvgate_pod_healthy",
    "kvgate_index_keys",
    "kvgate_kv_event_lag_seconds_bucket",
}


def exported_series(exposition: str) -> set[str]:
    """Every series name the exposition can carry, from its ``# TYPE`` lines."""
    names: set[str] = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M):
        if kind == "histogram":
            names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
        elif kind == "counter" and not family.endswith("_total"):
            names.add(f"{family}_total")
        else:
            names.add(family)
    return names


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


@pytest.fixture(scope="module")
def live_metrics(redis_server, tmp_path_factory) -> str:
    kubeconfig = tmp_path_factory.mktemp("kube") / "config"
    closed = f"http://127.0.0.1:{free_port()}"  # discovery on, API unreachable: still exported
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "none", "cluster": {"server": closed}}],
                "users": [{"name": "none", "user": {"token": "x"}}],
                "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
                "current-context": "none",
            }
        )
    )
    env = {
        "KVGATE_INDEX__BACKEND": "redis",
        "KVGATE_INDEX__REDIS_URL": redis_server.url,
        "KVGATE_INDEX__NAMESPACE": f"dash{free_port()}",
        "KVGATE_DISCOVERY__ENABLED": "true",
        "KVGATE_DISCOVERY__KUBECONFIG": str(kubeconfig),
    }
    with sim_fleet(2, kv_events=True) as pods:
        specs = [
            (p.name, f"{p.url},events={p.events_endpoint},replay={p.replay_endpoint}") for p in pods
        ]
        with run_gateway(specs, strategy="kv-aware", env=env) as gw:
            client = openai.OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
            for _ in range(4):
                client.chat.completions.create(
                    model="kvgate-tiny-llama",
                    messages=[{"role": "user", "content": "a shared prefix " * 40}],
                    max_tokens=2,
                )
            return httpx.get(f"{gw}/metrics").text


@pytest.mark.redis
def test_dashboard_queries_use_only_metrics_the_gateway_exports(live_metrics):
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in expressions(dashboard) for name in NAME.findall(expr)}
    exported = exported_series(live_metrics)
    assert used - exported == set()
    assert REQUIRED - used == set()


def test_exported_series_derivation_handles_histograms_and_counters():
    text = (
        "# TYPE kvgate_ttft_seconds histogram\n"
        "# TYPE kvgate_requests_total counter\n"
        "# TYPE kvgate_index_ops counter\n"
        "# TYPE kvgate_index_keys gauge\n"
    )
    assert exported_series(text) == {
        "kvgate_ttft_seconds_bucket",
        "kvgate_ttft_seconds_sum",
        "kvgate_ttft_seconds_count",
        "kvgate_requests_total",
        "kvgate_index_ops_total",
        "kvgate_index_keys",
    }


def test_dashboard_panels_are_well_formed_grafana_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "job"}
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_dashboard_queries_parse_as_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    dashboard = json.loads(DASHBOARD.read_text())
    rules = [
        {"record": f"kvgate:dashboard_query_{i}", "expr": expr}
        for i, expr in enumerate(
            t["expr"].replace("$__rate_interval", "5m").replace("$job", ".*")
            for p in panels(dashboard)
            for t in p["targets"]
        )
    ]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
