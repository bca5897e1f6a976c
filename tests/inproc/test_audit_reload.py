"""Config audit, hot reload: a new config with an operator's mistake in it (a typo'd
nested key, a duplicate pod name, options for no strategy, a level logging does not
know, a number that cannot be, a pod address that is not one) is rejected whole, with
a message naming the setting, and the gateway keeps serving with what it had."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.inproc.harness import FAST, InprocGateway, file_configured_gateway
from tests.inproc.scripted_pod import ScriptedPod


def write(path: Path, **settings: Any) -> None:
    path.write_text(yaml.safe_dump({**FAST, **settings}))


async def reload(g: InprocGateway) -> dict[str, Any]:
    r = await g.admin.post("/admin/reload")
    assert r.status_code in (200, 422), r.text
    return r.json()


def pod(p: ScriptedPod, **extra: Any) -> dict[str, Any]:
    return {"name": p.name, "url": p.url, **extra}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"timeouts": {**FAST["timeouts"], "totl_s": 1}}, "timeouts.totl_s: Extra inputs"),
        ({"health": {**FAST["health"], "interval": 1}}, "health.interval: Extra inputs"),
        ({"pods": "DUP"}, "pod names must be unique: pod-a"),
        ({"pods": "TYPO"}, "pods.0.kv_event: Extra inputs"),
        ({"pods": "NOSCHEME"}, "pods.0.url"),
        ({"strategy_options": {"kv-awar": {}}}, "strategy_options: Value error, unknown strategy"),
        ({"strategy": "kv-aware", "strategy_options": {"kv-aware": {"eviction_weight": "x"}}},
         "strategy_options.kv-aware: TypeError"),
        ({"strategy_options": {"kv-aware": 3}}, "kv-aware: options must be a mapping"),
        ({"log_level": "verbose"}, "log_level"),
        ({"timeouts": {**FAST["timeouts"], "first_byte_s": -2, "total_s": -1}}, "timeouts."),
        ({"retry": {"max_attempts": 0}}, "retry.max_attempts"),
        ({"max_body_bytes": -1}, "max_body_bytes"),
        ({"default_block_size": 0}, "default_block_size"),
        ({"models": {"m": {"block_size": -16}}}, "models.m.block_size"),
        ({"index": {"backend": "redis"}}, "index.redis_url"),
    ],
    ids=["nested-typo", "health-typo", "duplicate-pod", "pod-typo", "pod-url",
         "options-of-no-strategy", "option-of-a-wrong-type", "options-not-a-mapping",
         "log-level", "negative-timeouts",
         "no-attempts", "negative-body-limit", "zero-block-size", "negative-model-block",
         "redis-without-url"],
)  # fmt: skip
async def test_a_mistake_in_the_new_config_is_rejected_and_the_running_one_stays(
    tmp_path, pod_a, pod_b, caplog, change, reason
):
    path = tmp_path / "kvgate.yaml"
    write(path, pods=[pod(pod_a), pod(pod_b)])
    async with file_configured_gateway(path) as g:
        if change.get("pods") == "DUP":
            change = {"pods": [pod(pod_a), {**pod(pod_b), "name": pod_a.name}]}
        elif change.get("pods") == "TYPO":
            change = {"pods": [pod(pod_a, kv_event="tcp://127.0.0.1:5557"), pod(pod_b)]}
        elif change.get("pods") == "NOSCHEME":
            change = {"pods": [{**pod(pod_a), "url": pod_a.url.split("://")[1]}, pod(pod_b)]}
        write(path, **{"pods": [pod(pod_a), pod(pod_b)], **change})
        with caplog.at_level(logging.ERROR, logger="kvgate.reload"):
            answer = await reload(g)

        assert answer["result"] == "rejected", answer
        assert reason in answer["reason"]
        assert g.metric("kvgate_config_reloads_total", result="rejected") == 1
        assert sorted(p.name for p in g.gw.registry.all()) == ["pod-a", "pod-b"]
        assert (await g.chat()).status_code == 200
