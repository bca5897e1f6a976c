"""The metric names the README's Metrics table lists."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_metric_names() -> set[str]:
    section = README.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(kvgate_[a-z_]+)`", section))
