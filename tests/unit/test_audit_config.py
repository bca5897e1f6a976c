"""Config audit, start-up: an operator's mistake in the file, the environment or a flag
stops ``kvgate serve`` with exit status 2 and one line naming the setting (never a
traceback, never a silent default), and the README lists every setting there is."""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

import gateway.server
from cli.main import main
from gateway.config import Settings
from gateway.server import serve as real_serve

README = Path(__file__).resolve().parents[2] / "README.md"
POD = "pods: [{name: a, url: 'http://127.0.0.1:9'}]\n"


@pytest.fixture(autouse=True)
def _keep_sighup():
    """``kvgate serve`` ignores SIGHUP until the gateway runs; the test process must not."""
    before = signal.getsignal(signal.SIGHUP)
    yield
    signal.signal(signal.SIGHUP, before)


@pytest.fixture(autouse=True)
def _never_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings that should be refused but are not would start a gateway that runs until
    killed: fail the test instead (a test that means to reach the listeners puts
    ``real_serve`` back)."""

    def started(*args: Any) -> None:
        pytest.fail("kvgate serve started serving settings it should have refused")

    monkeypatch.setattr(gateway.server, "serve", started)


def serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["serve", "--workers", "1", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("porrt: 9000\n" + POD, "porrt: Extra inputs are not permitted"),
        ("timeouts: {conect_s: 1}\n" + POD, "timeouts.conect_s: Extra inputs"),
        ("pods: [{name: a, url: 'http://h:1', kv_event: 'tcp://h:2'}]\n", "pods.0.kv_event"),
        ("index: {capacty_keys: 5}\n" + POD, "index.capacty_keys"),
        ("port: abc\n" + POD, "port: Input should be a valid integer"),
        ("port: -1\n" + POD, "port: Input should be greater than or equal to 0"),
        ("port: 70000\n" + POD, "port: Input should be less than or equal to 65535"),
        ("timeouts: {total_s: -1, first_byte_s: -2}\n" + POD, "timeouts.first_byte_s"),
        ("health: {interval_s: 0}\n" + POD, "health.interval_s: Input should be greater"),
        ("retry: {max_attempts: 0}\n" + POD, "retry.max_attempts"),
        ("max_body_bytes: -1\n" + POD, "max_body_bytes: Input should be greater"),
        ("index: {capacity_keys: 0}\n" + POD, "index.capacity_keys"),
        ("default_block_size: 0\n" + POD, "default_block_size"),
        ("models: {m: {block_size: -16}}\n" + POD, "models.m.block_size"),
        ("pods: [{name: a, url: '127.0.0.1:1'}]\n", "pods.0.url: Value error, '127.0.0.1:1'"),
        ("pods: [{name: a, url: 'http://h:1', kv_events: junk}]\n", "pods.0.kv_events"),
        ("pods: [{name: a, url: 'http://h:1'}, {name: a, url: 'http://h:2'}]\n",
         "pod names must be unique: a given twice"),
        ("index: {backend: redis}\n" + POD, "index.backend 'redis' needs index.redis_url"),
        ("tenant_isolation: {enabled: true, source: header}\n" + POD,
         "tenant_isolation.enabled needs tenant_isolation.secret"),
        ("log_level: verbose\n" + POD, "log_level: Value error, must be one of"),
        ("strategy: kv-awar\n" + POD, "strategy: Value error, unknown strategy 'kv-awar'"),
        ("model_strategies: {m: fastest}\n" + POD, "unknown strategy 'fastest'"),
        ("strategy_options: {kvaware: {}}\n" + POD, "under its canonical name 'kv-aware'"),
        ("strategy_options: {kv-aware: 3}\n" + POD, "kv-aware: options must be a mapping"),
        ("strategy: kv-aware\nstrategy_options: {kv-aware: {eviction_weight: lots}}\n" + POD,
         "strategy_options.kv-aware: TypeError"),
        ("strategy: kv-aware\nstrategy_options: {kv-aware: {evction_weight: 1}}\n" + POD,
         "strategy_options.kv-aware: TypeError: KvAware.__init__() got an unexpected keyword"),
        ("", "is empty"),
        ("# nothing but a comment\n", "is empty"),
        ("pods: [{name: a\nport: : 3\n", "bad YAML: "),
        ("- a\n- b\n", "must be a mapping of settings (key: value), not list"),
    ],
)  # fmt: skip
def test_a_bad_config_file_stops_start_up_with_one_line_naming_the_setting(
    tmp_path, capsys, config, message
):
    path = tmp_path / "kvgate.yaml"
    path.write_text(config)
    code, err = serve(capsys, "--config", str(path))
    assert code == 2
    assert err.startswith("kvgate serve: invalid settings: ") and message in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_a_missing_file_or_a_directory_is_named(tmp_path, capsys):
    code, err = serve(capsys, "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read the config file: No such file" in err
    code, err = serve(capsys, "--config", str(tmp_path))
    assert code == 2 and "cannot read the config file: Is a directory" in err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVGATE_TIMEOUTS__CONECT_S": "1"}, "timeouts.conect_s: Extra inputs"),
        ({"KVGATE_MODELS": "{m: 1}"}, 'error parsing value for field "models"'),
        ({"KVGATE_MODELS": '{"m": {"block_size": "big"}}'}, "models.m.block_size"),
        ({"KVGATE_PODS": "a=http://h:1,foo=bar"}, "unknown pod option 'foo'; known: events"),
        ({"KVGATE_PODS": "a=http://h:1 a=http://h:2"}, "pod names must be unique"),
        ({"KVGATE_HEALTH__INTERVAL_S": "0"}, "health.interval_s"),
    ],
)
def test_a_bad_environment_variable_stops_start_up_naming_the_setting(
    monkeypatch, capsys, env, message
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = [] if "KVGATE_PODS" in env else ["--pod", "a=http://127.0.0.1:9"]
    code, err = serve(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("KVGATE_STRATGY", "KVGATE_STRATGY is not a setting (did you mean KVGATE_STRATEGY?)"),
        ("KVGATE_ADMIN_PORT", "ADMIN_PORT is not a setting (did you mean KVGATE_ADMIN__PORT?)"),
        ("KVGATE_TIMEOUT__FIRST_BYTE_S", "(did you mean KVGATE_TIMEOUTS__FIRST_BYTE_S?)"),
        ("kvgate_workerz", "kvgate_workerz is not a setting (did you mean KVGATE_WORKERS?)"),
        ("KVGATE_FOO", "KVGATE_FOO is not a setting"),
    ],
)  # fmt: skip
def test_a_kvgate_variable_that_is_no_setting_stops_start_up_naming_what_it_meant(
    monkeypatch, capsys, name, message
):
    """Read as nothing, KVGATE_STRATGY=kv-aware would serve round-robin in silence."""
    monkeypatch.setenv(name, "8001")
    code, err = serve(capsys, "--pod", "a=http://127.0.0.1:9")
    assert code == 2 and err.startswith("kvgate serve: invalid settings: ") and message in err, err
    assert "8001" not in err  # values are never echoed (a variable may hold a key)


def test_service_links_and_the_tools_variables_are_not_taken_for_settings(monkeypatch, capsys):
    """What a Service named kvgate (and kvgate-redis) sets in a pod, and what kvgate's
    other commands read, start the gateway with the settings it was given."""
    monkeypatch.setattr(gateway.server, "serve", lambda settings, source: served.append(settings))
    served: list[Settings] = []
    for name, value in {
        "KVGATE_PORT": "tcp://10.96.0.12:80",
        "KVGATE_PORT_80_TCP": "tcp://10.96.0.12:80",
        "KVGATE_PORT_80_TCP_PROTO": "tcp",
        "KVGATE_PORT_80_TCP_PORT": "80",
        "KVGATE_PORT_80_TCP_ADDR": "10.96.0.12",
        "KVGATE_SERVICE_HOST": "10.96.0.12",
        "KVGATE_SERVICE_PORT": "80",
        "KVGATE_SERVICE_PORT_HTTP": "80",
        "KVGATE_REDIS_PORT": "tcp://10.96.0.13:6379",
        "KVGATE_REDIS_SERVICE_HOST": "10.96.0.13",
        "KVGATE_PEERS_HOME": "/tmp/peers",
        "KVGATE_KEEP_LOGS": "1",
        "KVGATE_ADMIN_URL": "http://127.0.0.1:8001",
    }.items():
        monkeypatch.setenv(name, value)
    assert serve(capsys, "--pod", "a=http://127.0.0.1:9") == (0, "")
    assert served[0].port == 8000
    monkeypatch.setenv("KVGATE_PORT", "tcp//10.96.0.12:80")  # not a link: read, and refused
    code, err = serve(capsys, "--pod", "a=http://127.0.0.1:9")
    assert code == 2 and "port: Input should be a valid integer" in err, err


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("a=http://h:1,dp_ranks=abc", "--pod a=http://h:1: dp_ranks: Input should be a valid"),
        ("a=http://h:1,event=tcp://h:2", "--pod a=http://h:1: unknown pod option 'event'"),
        ("a=http://h:1,api_key=s3cret,bogus=1", "unknown pod option 'bogus'"),
        ("=http://h:1", "--pod =http://h:1: name: String should have at least 1 character"),
        ("a=", "--pod a=: url: Value error, 'a=' is not an http://"),
        ("a=http://h:1,events=tcp://h", "kv_events: Value error, 'tcp://h' needs a host"),
    ],
)  # fmt: skip
def test_a_bad_pod_flag_stops_start_up_naming_the_flag(capsys, flag, message):
    code, err = serve(capsys, "--pod", flag)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert "s3cret" not in err  # a pod's key is never echoed


def test_serving_and_admin_on_one_port_or_a_bad_log_level_flag_are_refused(capsys):
    code, err = serve(capsys, "--port", "18555", "--admin-port", "18555", "--pod", "a=http://h:1")
    assert code == 2 and "admin.port must differ from port" in err
    code, err = serve(capsys, "--log-level", "loud", "--pod", "a=http://h:1")
    assert code == 2 and "log_level" in err


def test_a_port_already_taken_is_one_line_not_a_traceback(capsys, monkeypatch):
    monkeypatch.setattr(gateway.server, "serve", real_serve)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--host", "127.0.0.1", "--port", str(port), "--admin-port", "0"]
        code, err = serve(capsys, *args, "--pod", "a=http://127.0.0.1:9")
    assert code == 2, err
    assert err.strip() == (
        f"kvgate serve: cannot listen on 127.0.0.1:{port} and admin 127.0.0.1:0: "
        "Address already in use"
    )


def _keys(value: Any, prefix: str = "") -> set[str]:
    if not isinstance(value, dict):
        return {prefix}
    return {k for key, v in value.items() for k in _keys(v, f"{prefix}.{key}" if prefix else key)}


# Sections the README shows by example (a pod, a model, kv-aware's options): their keys
# are the example's, not Settings' defaults.
EXAMPLES = ("pods", "models", "strategy_options", "model_strategies")


def test_the_readme_documents_every_setting_with_its_default():
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)
    (example,) = [b for b in blocks if b.startswith("# kvgate.yaml")]
    documented = yaml.safe_load(example)
    defaults = Settings().model_dump()
    doc_keys = {k for k in _keys(documented) if not k.startswith(EXAMPLES)}
    code_keys = {k for k in _keys(defaults) if not k.startswith(EXAMPLES)}
    assert doc_keys == code_keys
    for key in sorted(doc_keys - {"strategy"}):  # shown as kv-aware, "default: round-robin"
        doc, code = documented, defaults
        for part in key.split("."):
            doc, code = doc[part], code[part]
        assert doc == code, key
