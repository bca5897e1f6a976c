"""``bench.index_stalls``: the memory index and bare dicts churned past capacity."""

from __future__ import annotations

from collections import OrderedDict

from rich.console import Console
from rich.progress import Progress

from bench import index_stalls
from bench.index_stalls import BLOCKS, churn_dict, churn_store


def test_the_store_is_timed_only_once_full_and_stays_within_its_capacity(monkeypatch) -> None:
    made = []
    real = index_stalls.MemoryStore

    def spy(capacity: int) -> index_stalls.MemoryStore:
        made.append(real(capacity))
        return made[-1]

    monkeypatch.setattr(index_stalls, "MemoryStore", spy)
    with Progress(console=Console(quiet=True)) as progress:
        times = churn_store(BLOCKS * 50, rounds=1.0, progress=progress)

    assert len(times) == 50  # the filling calls (50) are not kept, the next 50 are
    assert all(t > 0 for t in times)
    store = made[0]
    assert store.stats_now().keys == store.capacity  # full, and evicting
    assert store.capacity_evictions == BLOCKS * 50


def test_a_bare_dict_keeps_its_size_while_churned() -> None:
    with Progress(console=Console(quiet=True)) as progress:
        times = churn_dict(OrderedDict, BLOCKS * 20, rounds=0.5, progress=progress)
    assert len(times) == 10 and all(t > 0 for t in times)
