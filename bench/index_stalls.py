"""The memory index at capacity: how long each lookup-and-speculation takes, and the
stalls when its tables rebuild, per capacity.

A gateway's index at capacity evicts a key for every key it adds. A CPython dict
that is added to and deleted from rebuilds its table in one C call each time its
append-only entry array fills (every ~1.8x its size in inserts), and the event loop
waits for it. This drives a ``MemoryStore`` as the router does on new prompts (a
lookup, then speculation of the prompt's 64 keys on one of two pods; the collector
set as the gateway sets it, ``gateway.heap``), fills it to capacity and goes on for
twice as many keys again, then reports per capacity the calls' p50 and p99, the
slowest calls and how many took over 10 ms. ``--plain`` adds a bare dict and
``OrderedDict`` of each capacity churned alike (64 inserts and 64 deletions of the
oldest a call), to show the rebuilds are theirs.

    python -m bench.index_stalls                                   # 200k, 500k, 2M keys
    python -m bench.index_stalls --capacity 2000000 --plain --out reports/index-stalls
"""

from __future__ import annotations

import argparse
import random
import time
from collections import OrderedDict
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.stats import percentile
from gateway.heap import settle
from kvindex.memory_store import MemoryStore

BLOCKS = 64  # an ~8 KB prompt at 32 tokens a block: the overhead benchmark's
CAPACITIES = (200_000, 500_000, 2_000_000)  # 2M: the gateway's default


def churn_store(capacity: int, rounds: float, progress: Progress) -> list[float]:
    """Seconds of each lookup + speculation of a new ``BLOCKS``-key prompt once the
    index is full (the filling calls are not kept)."""
    store = MemoryStore(capacity)
    settle()  # the gateway's collector settings: its heap frozen, young collections rare
    rng = random.Random(7)
    full_at = capacity // BLOCKS
    calls = int(capacity * (1 + rounds)) // BLOCKS
    task = progress.add_task(f"MemoryStore of {capacity:,}", total=calls)
    times: list[float] = []
    clock = time.perf_counter
    for i in range(calls):
        keys = [rng.getrandbits(63) for _ in range(BLOCKS)]
        started = clock()
        store.match_now(keys, 32)
        store.speculate_now("pod-a" if i & 1 else "pod-b", keys, 30.0)
        if i >= full_at:
            times.append(clock() - started)
        if i % 1024 == 0:
            progress.update(task, completed=i)
    progress.update(task, completed=calls)
    return times


def churn_dict(
    kind: type[dict[int, None]], size: int, rounds: float, progress: Progress
) -> list[float]:
    """Seconds of each ``BLOCKS`` inserts and as many deletions of the oldest keys."""
    d = kind.fromkeys(range(size))
    task = progress.add_task(f"{kind.__name__} of {size:,}", total=int(size * rounds))
    times: list[float] = []
    clock = time.perf_counter
    oldest, new = 0, size
    while new < size * (1 + rounds):
        started = clock()
        for key in range(new, new + BLOCKS):
            d[key] = None
        for key in range(oldest, oldest + BLOCKS):
            del d[key]
        times.append(clock() - started)
        oldest, new = oldest + BLOCKS, new + BLOCKS
        if len(times) % 1024 == 0:
            progress.update(task, completed=new - size)
    progress.update(task, completed=int(size * rounds))
    return times


def _plot(rows: list[tuple[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, times in rows:
        xs = [i / len(times) for i in range(len(times))]
        ax.scatter(xs, [t * 1e3 for t in times], s=2, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("calls once full (fraction of the run)")
    ax.set_ylabel("ms a call")
    ax.set_title(f"{BLOCKS} keys added and as many evicted a call")
    ax.legend(markerscale=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, action="append", default=None,
                        help="index keys (repeatable; default 200k, 500k and 2M)")  # fmt: skip
    parser.add_argument(
        "--rounds", type=float, default=2.0, help="keys added once full, x capacity"
    )
    parser.add_argument("--plain", action="store_true", help="also a dict and an OrderedDict")
    parser.add_argument("--out", type=Path, default=None, help="a folder for report.md and a plot")
    args = parser.parse_args()
    console = Console(width=120)
    rows: list[tuple[str, list[float]]] = []
    with Progress(console=console, transient=True) as progress:
        for capacity in args.capacity or CAPACITIES:
            rows.append(
                (f"MemoryStore, {capacity:,} keys", churn_store(capacity, args.rounds, progress))
            )
            for kind in (dict, OrderedDict) if args.plain else ():
                rows.append((f"{kind.__name__}, {capacity:,} keys",
                             churn_dict(kind, capacity, args.rounds, progress)))  # fmt: skip
    title = (f"{BLOCKS} keys added and as many evicted a call, once full "
             f"({args.rounds:g}x capacity more)")  # fmt: skip
    table = Table(title=title)
    heads = ("what", "calls", "p50 µs", "p99 µs", "max ms", "calls over 10 ms", "the 5 slowest, ms")
    for head in heads:
        table.add_column(head, justify="left" if head == "what" else "right")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for name, times in rows:
        slowest = sorted(times)[-5:][::-1]
        cells = [name, f"{len(times):,}", f"{percentile(times, 50) * 1e6:.1f}",
                 f"{percentile(times, 99) * 1e6:.1f}", f"{slowest[0] * 1e3:.1f}",
                 str(sum(t > 0.010 for t in times)),
                 ", ".join(f"{t * 1e3:.1f}" for t in slowest)]  # fmt: skip
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        _plot(rows, args.out / "index-stalls.png")
        (args.out / "report.md").write_text(
            f"{title}\n\n" + "\n".join(lines) + "\n\n![index-stalls.png](index-stalls.png)\n"
        )
        console.print(f"report: {args.out / 'report.md'}")


if __name__ == "__main__":
    main()
