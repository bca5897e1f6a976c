"""Hot reload in-process: ``POST /admin/reload`` re-reads the config file and applies it
to the running gateway (pods, strategies, keys, admission, model settings), or refuses
it whole and keeps serving with what runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.polling import wait_for_async
from gateway.app import create_app
from gateway.config import SettingsSource
from gateway.server import reload_on_sighup
from tests.inproc.harness import FAST, InprocGateway, file_configured_gateway, inproc_gateway
from tests.inproc.scripted_pod import MODEL, ScriptedPod, delta, hang, sse, stream

PIECES = [sse(delta(str(i))) for i in range(6)]


class ConfigFile:
    """The gateway's YAML settings file, rewritten by the test."""

    def __init__(self, path: Path, **settings: Any) -> None:
        self.path = path
        self.settings: dict[str, Any] = {**FAST, **settings}
        self.write()

    def write(self, **changes: Any) -> None:
        self.settings.update(changes)
        self.path.write_text(yaml.safe_dump(self.settings))


def pods(*scripted: ScriptedPod) -> list[dict[str, Any]]:
    return [{"name": p.name, "url": p.url} for p in scripted]


def reload_log(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvgate.reload"]


async def reload(g: InprocGateway, **headers: str) -> dict[str, Any]:
    r = await g.admin.post("/admin/reload", headers=headers)
    assert r.status_code in (200, 422), r.text
    return r.json()


async def test_a_pod_added_to_the_file_takes_traffic_and_one_removed_leaves_it(
    tmp_path, pod_a, pod_b
):
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a))
    async with file_configured_gateway(config.path) as g:
        assert (await g.chat()).headers["x-kvgate-pod"] == "pod-a"

        config.write(pods=pods(pod_b))
        answer = await reload(g)

        assert answer == {"result": "applied", "changed": ["pods[pod-a]", "pods[pod-b]"],
                          "needs_restart": []}  # fmt: skip
        assert [p.name for p in g.gw.registry.all()] == ["pod-b"]
        served = [(await g.chat()).headers["x-kvgate-pod"] for _ in range(3)]
        assert served == ["pod-b"] * 3
        assert len(pod_a.received) == 1
        assert g.metric("kvgate_config_reloads_total", result="applied") == 1


async def test_rotated_client_and_admin_keys_take_effect_at_once(tmp_path, pod_a):
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a), api_keys=["old-key"],
                        admin={"api_keys": ["old-admin"]})  # fmt: skip
    async with file_configured_gateway(config.path) as g:
        assert (await g.chat(headers={"authorization": "Bearer old-key"})).status_code == 200

        config.write(api_keys=["new-key"], admin={"api_keys": ["new-admin"]})
        answer = await reload(g, authorization="Bearer old-admin")

        assert answer["changed"] == ["admin.api_keys", "api_keys"]
        assert (await g.chat(headers={"authorization": "Bearer old-key"})).status_code == 401
        assert (await g.chat(headers={"authorization": "Bearer new-key"})).status_code == 200
        old_admin = await g.admin.get(
            "/admin/bounds", headers={"authorization": "Bearer old-admin"}
        )
        new_admin = await g.admin.get(
            "/admin/bounds", headers={"authorization": "Bearer new-admin"}
        )
        assert (old_admin.status_code, new_admin.status_code) == (401, 200)


async def test_a_stream_in_flight_finishes_on_its_strategy_and_keeps_its_load_counted(
    tmp_path, pod_a, pod_b
):
    pod_a.script(stream(PIECES, delay_s=0.05))
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a, pod_b), strategy="round-robin")
    async with file_configured_gateway(config.path) as g:
        call = g.stream_chat()
        await call.received(1)

        config.write(strategy="least-loaded")
        assert (await reload(g))["changed"] == ["strategy"]
        assert g.load("pod-a") == 1  # the stream's load is still counted ...
        after = await g.chat()  # ... so least-loaded sends the next request elsewhere
        await call.finished()

        assert (after.headers["x-kvgate-pod"], after.headers["x-kvgate-strategy"]) == (
            "pod-b", "least-loaded")  # fmt: skip
        assert (call.status, call.headers["x-kvgate-strategy"], call.body) == (
            200, "round-robin", b"".join(PIECES))  # fmt: skip
        assert g.load("pod-a") == 0


async def test_a_strategy_whose_name_and_options_did_not_change_keeps_what_it_learnt(
    tmp_path, pod_a
):
    options = {"kv-aware": {"calibrate": True}}
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a), strategy="kv-aware",
                        strategy_options=options)  # fmt: skip
    async with file_configured_gateway(config.path) as g:
        running = g.gw.router.strategy_for(MODEL)

        config.write(api_keys=["k"], strategy="kvaware")  # an alias of the same strategy
        await reload(g)
        kept = g.gw.router.strategy_for(MODEL)
        config.write(strategy_options={"kv-aware": {"calibrate": False}})
        await reload(g)

        assert kept is running
        assert g.gw.router.strategy_for(MODEL) is not running


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"strategy": "fastest-pod"}, "unknown strategy 'fastest-pod'"),
        ({"strategy_options": {"round-robin": {"speed": 2}}},
         "unexpected keyword argument 'speed'"),
        ({"timeouts": {"first_byte_s": 10, "total_s": 5}}, "first_byte_s must not exceed"),
        ({"api_keys": ["shared"], "admin": {"api_keys": ["shared"]}},
         "an admin key must not also be a client key"),
        ({"pods": [{"url": "http://10.0.0.9:8000"}]}, "pods.0.name: Field required"),
    ],
    ids=["unknown-strategy", "bad-strategy-option", "bad-timeouts", "admin-key-reused", "bad-pods"],
)  # fmt: skip
async def test_a_config_that_is_not_valid_is_rejected_and_the_running_one_stays(
    tmp_path, pod_a, caplog, change, reason
):
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a), api_keys=["k1"])
    async with file_configured_gateway(config.path) as g:
        config.write(**change)
        with caplog.at_level(logging.ERROR, logger="kvgate.reload"):
            answer = await reload(g)

        assert answer["result"] == "rejected" and reason in answer["reason"]
        assert "shared" not in answer["reason"]  # never a key's value
        assert reload_log(caplog) == [
            f"config reload (POST /admin/reload) rejected, the running settings stay: "
            f"{answer['reason']}"
        ]
        assert g.metric("kvgate_config_reloads_total", result="rejected") == 1
        assert g.gw.settings.api_keys == ["k1"]
        assert (await g.chat(headers={"authorization": "Bearer k1"})).status_code == 200


async def test_bad_yaml_and_an_emptied_file_are_rejected(tmp_path, pod_a):
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a))
    async with file_configured_gateway(config.path) as g:
        config.path.write_text("pods: [\n")
        bad_yaml = await reload(g)
        config.path.write_text("")
        empty = await reload(g)

        assert bad_yaml["reason"].startswith("bad YAML: expected the node content")
        assert empty["reason"] == f"ValueError: config file {config.path} is empty"
        assert [p.name for p in g.gw.registry.all()] == ["pod-a"]


async def test_settings_that_need_a_restart_are_reported_and_left_as_they_run(
    tmp_path, pod_a, caplog
):
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a))
    async with file_configured_gateway(config.path) as g:
        config.write(port=9100, index={"backend": "redis", "redis_url": "redis://x"},
                     retry={**FAST["retry"], "max_attempts": 1})  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="kvgate.reload"):
            answer = await reload(g)

        restart = ["index.backend", "index.redis_url", "port"]
        assert answer == {"result": "applied", "changed": ["retry.max_attempts"],
                          "needs_restart": restart}  # fmt: skip
        assert reload_log(caplog) == [
            "config reload (POST /admin/reload): index.backend, index.redis_url, port changed "
            "but needs a restart; the running value stays"]  # fmt: skip
        s = g.gw.settings
        assert (s.port, s.index.backend, s.retry.max_attempts) == (8000, "memory", 1)


ADMIT_ONE = {"enabled": True, "max_in_flight_per_pod": 1}


@contextlib.asynccontextmanager
async def requests_waiting(
    tmp_path: Path, pod: ScriptedPod, n: int
) -> AsyncIterator[tuple[InprocGateway, ConfigFile, list[asyncio.Task[httpx.Response]]]]:
    """A gateway that admits one request per pod, that one held by ``pod``, and ``n``
    requests waiting for it (their tasks)."""
    release = asyncio.Event()
    pod.script(hang(until=release))
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod), admission=ADMIT_ONE)
    async with file_configured_gateway(config.path) as g:
        first = g.stream_chat()
        await wait_for_async(lambda: len(pod.received) == 1, 2.0, "the first request held")
        waiting = [asyncio.create_task(g.chat()) for _ in range(n)]
        await wait_for_async(lambda: g.metric("kvgate_admission_queue_length") == n, 2.0,
                             f"{n} requests waiting")  # fmt: skip
        yield g, config, waiting
        release.set()
        await first.finished()


async def test_raised_admission_limits_let_a_waiting_request_go(tmp_path, pod_a):
    async with requests_waiting(tmp_path, pod_a, 1) as (g, config, waiting):
        config.write(admission={**ADMIT_ONE, "max_in_flight_per_pod": 2})
        await reload(g)
        answers = await asyncio.wait_for(asyncio.gather(*waiting), 2.0)

        assert [a.status_code for a in answers] == [200]
        assert g.metric("kvgate_admission_queue_length", priority="normal") == 0


async def test_switching_admission_off_releases_every_waiting_request(tmp_path, pod_a):
    async with requests_waiting(tmp_path, pod_a, 3) as (g, config, waiting):
        config.write(admission={"enabled": False})
        await reload(g)
        answers = await asyncio.wait_for(asyncio.gather(*waiting), 2.0)

        assert [a.status_code for a in answers] == [200, 200, 200]
        assert g.gw.admission is None and g.metric("kvgate_admission_queue_length") == 0


@pytest.mark.parametrize(
    ("model_settings", "reason"),
    [
        ({"ttft_slo_ms": 0}, f"models.{MODEL}.ttft_slo_ms: Input should be greater than 0"),
        ({"max_in_flight_per_pod": -1},
         f"models.{MODEL}.max_in_flight_per_pod: Input should be greater than or equal to 0"),
        # Accepted by the settings (> 0) but 0 in seconds: only the admission policy,
        # built by the validation, refuses it.
        ({"ttft_slo_ms": 5e-324}, f"ValueError: models.{MODEL}: admission: max_wait_s and "
                                  "ttft_slo_s must be > 0"),
    ],
    ids=["slo-0", "limit-negative", "slo-0-in-seconds"],
)  # fmt: skip
async def test_model_admission_settings_no_policy_takes_are_rejected_and_nothing_changes(
    tmp_path, pod_a, model_settings, reason
):
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a), admission=ADMIT_ONE,
                        api_keys=["k1"])  # fmt: skip
    async with file_configured_gateway(config.path) as g:
        key = {"authorization": "Bearer k1"}
        assert (await g.chat(headers=key)).status_code == 200  # the model has a queue now
        running, proxy = g.gw.settings, g.gw.proxy

        config.write(api_keys=["k2"], models={MODEL: model_settings})
        first, again = await reload(g), await reload(g)

        assert first == again
        assert (first["result"], first["reason"], first["changed"]) == ("rejected", reason, [])
        assert g.gw.settings is running and g.gw.proxy is proxy
        assert g.metric("kvgate_config_reloads_total", result="rejected") == 2
        assert (await g.chat(headers=key)).status_code == 200


async def test_a_changed_block_size_rebuilds_the_models_keys_and_a_tokenizer_its_tokenization(
    tmp_path, pod_a
):
    models = {MODEL: {"block_size": 16}, "other": {"block_size": 16}}
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a), models=models)
    async with file_configured_gateway(config.path) as g:
        kv = g.gw.kv
        keyers = {m: kv.keyer(m) for m in models}
        tokenizations = {m: kv.tokens.tokenization(m) for m in models}

        config.write(
            models={
                MODEL: {"block_size": 32},
                "other": {"block_size": 16, "tokenizer_mode": "engine"},
            }
        )
        answer = await reload(g)

        assert answer["changed"] == ["models.other.tokenizer_mode", f"models.{MODEL}.block_size"]
        assert (kv.keyer(MODEL).block_size, kv.keyer("other") is keyers["other"]) == (32, True)
        assert kv.tokens.tokenization(MODEL) is tokenizations[MODEL]
        assert kv.tokens.tokenization("other") is not tokenizations["other"]


async def test_reload_without_a_settings_source_is_refused(pod_a):
    async with inproc_gateway(pod_a) as g:
        r = await g.admin.post("/admin/reload")

    assert r.status_code == 409


async def test_a_config_file_replaced_through_a_symlink_swap_is_reloaded(tmp_path, pod_a, pod_b):
    """As Kubernetes updates a mounted ConfigMap: ``config.yaml`` is a link into
    ``..data``, a link to a timestamped directory that is swapped whole."""
    first, second = tmp_path / "..2024_01", tmp_path / "..2024_02"
    first.mkdir()
    second.mkdir()
    reload_every = {"reload": {"watch_interval_s": 0.05}}
    ConfigFile(first / "config.yaml", pods=pods(pod_a), **reload_every)
    ConfigFile(second / "config.yaml", pods=pods(pod_b), **reload_every)
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    async with file_configured_gateway(tmp_path / "config.yaml") as g:
        (tmp_path / "..data_tmp").symlink_to(second.name)
        (tmp_path / "..data_tmp").replace(tmp_path / "..data")

        await wait_for_async(lambda: g.metric("kvgate_config_reloads_total", result="applied"),
                             3.0, "the swapped file to be reloaded")  # fmt: skip
        assert [p.name for p in g.gw.registry.all()] == ["pod-b"]
        assert (await g.chat()).headers["x-kvgate-pod"] == "pod-b"


async def test_a_config_file_changed_while_the_gateway_starts_is_applied_once_it_runs(
    tmp_path, pod_a
):
    """A worker reads its settings, then warms its tokenizers and starts its parts
    before its reloader watches the file: a change meanwhile, which its siblings apply,
    must not pass it by."""
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a), api_keys=["k1"],
                        reload={"watch_interval_s": 0.05})  # fmt: skip
    source = SettingsSource(config.path)
    read = source.load()
    config.write(api_keys=["k2"])  # while the gateway starts
    app = create_app(read, source=source)
    async with app.router.lifespan_context(app):
        gw = app.state.gw
        await wait_for_async(lambda: gw.settings.api_keys == ["k2"], 2.0,
                             "the file's change applied")  # fmt: skip


async def test_a_sighup_before_the_gateway_runs_is_acted_on_once_it_does(tmp_path, pod_a):
    """The supervisor passes SIGHUP to every worker, a starting one too."""
    no_watch = {"watch_config": False}  # a SIGHUP alone reloads
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a), api_keys=["k1"],
                        reload=no_watch)  # fmt: skip
    source = SettingsSource(config.path)
    previous = signal.getsignal(signal.SIGHUP)
    reload_on_sighup()  # as ``kvgate serve`` does, before it reads the settings
    try:
        read = source.load()
        config.write(api_keys=["k2"])
        signal.raise_signal(signal.SIGHUP)  # while the gateway starts
        app = create_app(read, source=source)
        async with app.router.lifespan_context(app):
            gw = app.state.gw
            await wait_for_async(lambda: gw.settings.api_keys == ["k2"], 2.0,
                                 "the SIGHUP's reload applied")  # fmt: skip
    finally:
        signal.signal(signal.SIGHUP, previous)


def stored(tokens: list[int], block: int, hashes: list[int]) -> str:
    """One KV-event batch, as vLLM posts it: ``tokens`` stored in blocks of ``block``."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
             "token_ids": tokens, "block_size": block, "lora_id": None, "medium": "GPU",
             "lora_name": None}  # fmt: skip
    return json.dumps([0.0, [event], None])


async def test_a_changed_block_size_drops_the_pods_index_entries_and_keys_its_events_anew(
    tmp_path, pod_a
):
    tokens = list(range(1, 33))
    config = ConfigFile(tmp_path / "kvgate.yaml", pods=pods(pod_a),
                        models={MODEL: {"block_size": 16}})  # fmt: skip
    async with file_configured_gateway(config.path) as g:

        async def post(body: str) -> None:
            r = await g.admin.post("/admin/kv-events?pod=pod-a", content=body,
                                   headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 200, r.text

        async def held() -> tuple[int, dict[str, int]]:
            lookup = await g.admin.post(
                "/admin/index/lookup", json={"model": MODEL, "prompt": tokens}
            )
            stats = (await g.admin.get("/admin/index/stats")).json()
            pods_ = lookup.json()["pods"]
            in_l0 = stats["per_pod"].get("pod-a", {}).get("L0", 0)
            return in_l0, {p: v["l0_blocks"] for p, v in pods_.items()}

        await post(stored(tokens, 16, [1, 2]))
        before = await held()
        config.write(models={MODEL: {"block_size": 32}})
        await reload(g)
        dropped = await held()
        await post(stored(tokens, 32, [3]))
        after = await held()

    assert (before, dropped, after) == ((2, {"pod-a": 2}), (0, {}), (1, {"pod-a": 1}))
