"""What a reload reads and applies: the changes named by path, the restart-only settings
kept as they run, and a config that is not valid refused with a reason that shows no
secret."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.config import PodConfig, Settings, SettingsSource
from gateway.reload import ReloadRejected, check_admission, file_signature, validated
from gateway.settings_diff import changed_paths, needs_restart, runtime_settings

POD_A = PodConfig(name="a", url="http://10.0.0.1:8000")
POD_B = PodConfig(name="b", url="http://10.0.0.2:8000")


def test_changes_are_named_by_dotted_path_and_pods_by_name():
    old = Settings(pods=[POD_A, POD_B], models={"m": {"block_size": 16}})
    new = Settings(
        pods=[POD_A.model_copy(update={"api_key": "secret"}), PodConfig(name="c", url="http://c")],
        models={"m": {"block_size": 32}},
        timeouts={"first_byte_s": 60, "total_s": 60},
        api_keys=["k"],
    )

    assert changed_paths(old, new) == [
        "api_keys", "models.m.block_size", "pods[a]", "pods[b]", "pods[c]", "timeouts.first_byte_s",
        "timeouts.total_s",
    ]  # fmt: skip
    assert changed_paths(old, old.model_copy()) == []


def test_listeners_index_workers_and_tracing_need_a_restart_the_rest_does_not():
    restart = ["port", "admin.host", "index.redis_url", "workers", "tracing.enabled",
               "scale_out.load_interval_s", "timeouts.connect_s", "discovery.enabled"]  # fmt: skip
    runtime = ["api_keys", "admin.api_keys", "pods[a]", "strategy", "timeouts.total_s",
               "models.m.block_size", "admission.enabled", "log_level"]  # fmt: skip

    assert [p for p in restart + runtime if needs_restart(p)] == restart


def test_applied_settings_keep_the_running_restart_only_values():
    running = Settings(port=8000, index={"capacity_keys": 100}, timeouts={"connect_s": 1})
    new = Settings(port=9000, index={"capacity_keys": 200}, timeouts={"connect_s": 5,
                   "first_byte_s": 60, "total_s": 60}, api_keys=["k"])  # fmt: skip

    applied = runtime_settings(running, new)

    assert (applied.port, applied.index.capacity_keys, applied.timeouts.connect_s) == (
        8000, 100, 1)  # fmt: skip
    assert (applied.timeouts.total_s, applied.api_keys) == (60, ["k"])


def test_applied_settings_are_validated_as_a_whole():
    """The admin listener runs on a network address; a file that moves it back to
    loopback and drops the admin keys would leave it open where it still runs."""
    running = Settings(admin={"host": "0.0.0.0", "api_keys": ["adm"]})
    new = Settings(admin={"host": "127.0.0.1", "api_keys": []})

    with pytest.raises(ValueError, match="admin.host '0.0.0.0' is reachable from the network"):
        runtime_settings(running, new)


def test_flags_given_at_start_up_keep_winning_over_the_file(tmp_path: Path):
    config = tmp_path / "kvgate.yaml"
    config.write_text("strategy: kv-aware\nretry: {max_attempts: 5}\n")
    source = SettingsSource(config, {"strategy": "least-loaded"})

    new = validated(source, Settings(), None)

    assert (new.effective.strategy, new.effective.retry.max_attempts) == ("least-loaded", 5)
    assert new.strategies.default.name == "least-loaded"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("pods: [\n", "bad YAML: expected the node content, but found '<stream end>' (line 2, "
                      "column 1)"),
        ("api_keys: [hunter2]\nadmin: {api_keys: [hunter2]}\n",
         "Value error, an admin key must not also be a client key"),
        ("timeouts: {total_s: fast}\n", "timeouts.total_s: Input should be a valid number"),
        ("model_strategies: {m: fastest}\n",
         "model_strategies: Value error, unknown strategy 'fastest'"),
    ],
    ids=["yaml", "cross-field", "field", "strategy"],
)  # fmt: skip
def test_a_config_that_is_not_valid_is_refused_with_a_reason_that_shows_no_value(
    tmp_path: Path, text: str, reason: str
):
    config = tmp_path / "kvgate.yaml"
    config.write_text(text)

    with pytest.raises(ReloadRejected) as refused:
        validated(SettingsSource(config), Settings(), None)

    assert reason in str(refused.value)
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize(
    ("admission", "models", "where"),
    [
        ({"enabled": True}, {"m": {"ttft_slo_ms": 5e-324}}, "models.m"),
        ({"enabled": True, "ttft_slo_ms": 5e-324}, {}, "admission"),
    ],
    ids=["model", "default"],
)
def test_admission_settings_that_no_policy_takes_are_refused_before_anything_is_applied(
    tmp_path: Path, admission: dict, models: dict, where: str
):
    """5e-324 ms passes the settings' own check (> 0) but is 0 s, which a policy
    refuses: the validation builds the policies, so a reload says so rather than failing
    half way through ``Gateway.reconfigure``."""
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({"admission": admission, "models": models}))

    with pytest.raises(ReloadRejected) as refused:
        validated(SettingsSource(config), Settings(), None)

    assert str(refused.value) == (
        f"ValueError: {where}: admission: max_wait_s and ttft_slo_s must be > 0"
    )
    # With admission control off no policy is built, so none is checked (nor raises).
    check_admission(Settings(admission={**admission, "enabled": False}, models=models))


def test_a_missing_config_file_is_refused_not_read_as_no_settings(tmp_path: Path):
    with pytest.raises(ReloadRejected, match="cannot read the config file: No such file"):
        validated(SettingsSource(tmp_path / "gone.yaml"), Settings(), None)


def test_a_file_swapped_through_a_symlink_has_another_signature(tmp_path: Path):
    for version in ("..v1", "..v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "config.yaml").write_text("port: 8000\n")  # same size and text
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    before = file_signature(tmp_path / "config.yaml")

    (tmp_path / "..data_tmp").symlink_to("..v2")
    (tmp_path / "..data_tmp").replace(tmp_path / "..data")

    assert None not in (before, file_signature(tmp_path / "config.yaml"))
    assert file_signature(tmp_path / "config.yaml") != before
    assert file_signature(tmp_path / "missing.yaml") is None
