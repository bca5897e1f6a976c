"""Benchmark router names with a kvgate variant (``kv-aware/no-speculation``)."""

import pytest

from bench.des.cli import _strategy_options
from bench.variants import split_variant
from gateway.config import Settings


def test_a_plain_strategy_is_the_default_variant():
    strategy, variant = split_variant("kv-aware")
    assert (strategy, variant.name, variant.speculative_ttl_s) == ("kv-aware", "", 3.0)


def test_no_speculation_turns_the_gateways_speculation_off():
    strategy, variant = split_variant("kv-aware/no-speculation")
    assert strategy == "kv-aware" and variant.speculative_ttl_s == 0
    settings = Settings(_env_file=None, **{"index": {"speculative_ttl_s": 0}})
    assert variant.gateway_env() == {"KVGATE_INDEX__SPECULATIVE_TTL_S": "0.0"}
    assert settings.index.speculative_ttl_s == 0


def test_an_unknown_variant_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="no-speculation"):
        split_variant("kv-aware/no-speculatoin")


def test_the_des_gives_a_variant_its_strategys_options():
    options = _strategy_options("kv-aware/no-speculation", {"a": 1}, {"kv-aware": {"b": 2}})
    assert options == {"a": 1, "b": 2}


def test_default_cost_model_gives_kv_aware_no_options_so_the_shipped_cost_model():
    import json

    _, variant = split_variant("kv-aware/default-cost-model")
    env = variant.gateway_env()
    assert json.loads(env["KVGATE_STRATEGY_OPTIONS"]) == {"kv-aware": {}}
    assert env["KVGATE_INDEX__SPECULATIVE_TTL_S"] == "3.0"  # the rest as default


def test_no_eviction_cost_keeps_the_benchmarks_cost_model_and_zeroes_the_weight():
    import json

    _, variant = split_variant("kv-aware/no-eviction-cost")
    measured = {"cost_model": {"prefill_tokens_per_s": 41_431.0}, "eviction_weight": 1.0}
    env = variant.gateway_env(measured)
    assert json.loads(env["KVGATE_STRATEGY_OPTIONS"]) == {
        "kv-aware": {"cost_model": {"prefill_tokens_per_s": 41_431.0}, "eviction_weight": 0.0}
    }
    assert variant.kv_aware_options(None) == {"eviction_weight": 0.0}


def test_early_headers_turns_on_the_gateways_early_stream_headers(monkeypatch):
    strategy, variant = split_variant("round-robin/early-headers")
    env = variant.gateway_env()
    assert strategy == "round-robin" and env["KVGATE_STREAM_HEADERS_EARLY"] == "true"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings(_env_file=None).stream_headers_early is True
    assert split_variant("round-robin")[1].gateway_env().get("KVGATE_STREAM_HEADERS_EARLY") is None


def test_no_cached_cost_zeroes_the_measured_cost_per_cached_token_and_keeps_the_rest():
    import json

    from routing.cost_model import CostModel

    _, variant = split_variant("kv-aware/no-cached-cost")
    measured = {"cost_model": {"prefill_tokens_per_s": 29_000.0,
                               "prefill_s_per_cached_token": 6e-6}}  # fmt: skip
    options = json.loads(variant.gateway_env(measured)["KVGATE_STRATEGY_OPTIONS"])["kv-aware"]
    assert options == {"cost_model": {"prefill_tokens_per_s": 29_000.0,
                                      "prefill_s_per_cached_token": 0.0}}  # fmt: skip
    # The DES hands over the model object itself: the override lands on it too.
    des = variant.kv_aware_options({"cost_model": CostModel(prefill_s_per_cached_token=6e-6)})
    assert CostModel.from_dict(des["cost_model"]).prefill_s_per_cached_token == 0.0


def test_sglang_balance_gives_prefix_aware_sglang_routers_balance_gap(monkeypatch):
    import json

    from routing.strategy_set import StrategySet

    strategy, variant = split_variant("prefix-aware/sglang-balance")
    measured = {"cost_model": {"prefill_tokens_per_s": 46_379.0}}
    env = variant.gateway_env(measured)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None, strategy=strategy)
    built = StrategySet.build(settings.strategy, settings.strategy_options).default
    assert built.name == "prefix-aware" and built.balance_abs_threshold == 64
    shipped = StrategySet.build("prefix-aware", {}).default
    assert shipped.balance_abs_threshold == 8  # the variant changes the one setting only
    # The setting replaces the benchmark's: kv-aware's measured options stay in it.
    assert json.loads(env["KVGATE_STRATEGY_OPTIONS"])["kv-aware"] == measured


def test_the_des_runs_prefix_aware_sglang_balance_with_sglang_routers_gap(monkeypatch):
    import argparse

    from rich.progress import Progress

    import bench.des.cli as des_cli

    seen = {}

    def fake_run_des(requests, pods, strategy, spec, **kwargs):
        seen.update(strategy=strategy, options=kwargs["strategy_options"])
        return []

    monkeypatch.setattr(des_cli, "run_des", fake_run_des)
    monkeypatch.setattr(des_cli, "summarize_des", lambda *a: None)
    monkeypatch.setattr(des_cli, "spec_tiers", lambda spec: "L0")
    args = argparse.Namespace(event_delay_ms=0.0, scrape_interval_s=2.0, pod_slowdown=())
    des_cli._run(args, [], 0, 2, "prefix-aware/sglang-balance", None, {"capacity": 10},
                 None, Progress(disable=True), "cell")  # fmt: skip
    assert seen == {"strategy": "prefix-aware",
                    "options": {"capacity": 10, "balance_abs_threshold": 64}}  # fmt: skip
