"""The README's configuration example is real: it loads and builds every strategy."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.config import load_settings
from routing.strategy_registry import build_strategy

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_yaml() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)
    (example,) = [b for b in blocks if b.startswith("# kvgate.yaml")]
    return example


def test_readme_config_example_loads_with_the_values_it_shows(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_text(readme_yaml())
    s = load_settings(path)
    assert s.strategy == "kv-aware"
    assert [(p.name, p.kv_events) for p in s.pods] == [("a", "tcp://10.0.0.5:5557")]
    assert s.models["Qwen/Qwen2-7B-Instruct"].block_size == 16
    assert s.index.backend == "memory" and s.index.capacity_keys == 2_000_000
    assert s.max_body_bytes == 8 * 1024 * 1024
    strategy = build_strategy(s.strategy, s.strategy_options["kv-aware"])
    assert strategy.name == "kv-aware"
    assert s.admission == type(s.admission)()  # every admission default, as shown
    assert s.tracing == type(s.tracing)()  # and every tracing default


def test_flags_beat_env_beat_yaml(tmp_path, monkeypatch):
    path = tmp_path / "kvgate.yaml"
    path.write_text("port: 1111\nstrategy: session\nlog_level: debug\n")
    monkeypatch.setenv("KVGATE_PORT", "2222")
    monkeypatch.setenv("KVGATE_STRATEGY", "least-loaded")
    s = load_settings(path, port=3333)
    assert (s.port, s.strategy, s.log_level) == (3333, "least-loaded", "debug")
