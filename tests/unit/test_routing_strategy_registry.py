"""The strategy registry: every strategy and its HyperPod alias resolves by name; a
strategy set rebuilt for a reload keeps what did not change."""

import pytest

from routing.strategy_registry import available, canonical_name
from routing.strategy_set import StrategySet


def test_every_strategy_and_hyperpod_alias_resolves():
    assert available() == [
        "kv-aware", "least-loaded", "power-of-two", "prefix-aware", "random", "round-robin",
        "session",
    ]  # fmt: skip
    names = {
        "roundrobin": "round-robin",
        "prefixaware": "prefix-aware",
        "kvaware": "kv-aware",
        "session": "session",
        "least_loaded": "least-loaded",
    }
    assert {alias: canonical_name(alias) for alias in names} == names


KV = {"kv-aware": {"calibrate": False}}


def test_a_rebuilt_strategy_set_keeps_each_strategy_whose_name_and_options_did_not_change():
    running = StrategySet.build("kv-aware", KV, {"m1": "prefix-aware", "m2": "session"})

    rebuilt = StrategySet.build(
        "kvaware",  # the same strategy by its alias
        {**KV, "session": {"capacity": 10}},  # session's options changed
        {"m1": "prefix-aware", "m2": "session", "m3": "kv-aware"},
        reuse=running,
    )

    assert rebuilt.default is running.default
    assert rebuilt.for_model("m1") is running.for_model("m1")
    assert rebuilt.for_model("m2") is not running.for_model("m2")
    # m3 was served by the default kv-aware, with the same options: that object still
    assert rebuilt.for_model("m3") is running.default


def test_a_strategy_set_with_a_bad_name_or_option_fails_to_build():
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        StrategySet.build("round-robin", None, {"m": "fastest"})
    with pytest.raises(TypeError, match="speed"):
        StrategySet.build("round-robin", {"round-robin": {"speed": 2}})
