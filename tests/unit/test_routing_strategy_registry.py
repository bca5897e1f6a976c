"""The strategy registry: every strategy and its HyperPod alias resolves by name."""

from routing.strategy_registry import available, canonical_name


def test_every_strategy_and_hyperpod_alias_resolves():
    assert available() == ["kv-aware", "least-loaded", "prefix-aware", "round-robin", "session"]
    names = {
        "roundrobin": "round-robin",
        "prefixaware": "prefix-aware",
        "kvaware": "kv-aware",
        "session": "session",
        "least_loaded": "least-loaded",
    }
    assert {alias: canonical_name(alias) for alias in names} == names
