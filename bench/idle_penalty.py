"""What a pause between requests costs the next one: the gateway's work, cold.

``kvgate bench overhead`` measures added latency with paired *sequential* requests: the
gateway is idle between two of its requests while the client talks to the backend.
This times the same piece of the gateway's work (kv-aware's tokenization of the
benchmark's new ~8 KB chats, ``kvindex.tokenization``) three ways, in rounds that take
turns: back to back, after a sleep of ``--gap-ms`` (the process blocks, as the gateway
does in its event loop between sequential requests), and after spinning for as long
(the core stays busy with something else, as with the backend or the client on it).

    python -m bench.idle_penalty            # p50 per way, and the ratios
    python -m bench.idle_penalty --gap-ms 5 --requests 1500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable

from bench.overhead import Bodies
from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization.front import Tokenization
from kvindex.tokenization.local import LocalTokenizer
from kvindex.tokenization.prompt import ChatPrompt

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `kvgate serve` sets it
WAYS = ("back to back", "after a sleep", "after a spin")
WARM_UP = 300  # requests before timing: the segment and word caches fill


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _round(
    tok: Tokenization, bodies: Bodies, n: int, pause: Callable[[], object]
) -> list[float]:
    """Seconds each of ``n`` new prompts took to tokenize, each after ``pause()``."""
    out = []
    for _ in range(n):
        body = json.loads(bodies.varied())
        waited = pause()
        if asyncio.iscoroutine(waited):
            await waited
        started = time.perf_counter()
        await tok.chat(ChatPrompt.from_body(body))
        out.append(time.perf_counter() - started)
    return out


async def measure(gap_s: float, requests: int, rounds: int) -> dict[str, list[float]]:
    """Per way, the tokenization times of every round's requests (seconds)."""
    tok = Tokenization("m", local=LocalTokenizer(str(ensure_tokenizer())))
    bodies = Bodies(8192, seed=5)
    pauses: dict[str, Callable[[], object]] = {
        "back to back": lambda: None,
        "after a sleep": lambda: asyncio.sleep(gap_s),
        "after a spin": lambda: _spin(gap_s),
    }
    await _round(tok, bodies, WARM_UP, pauses["back to back"])
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            times[way] += await _round(tok, bodies, requests // rounds, pauses[way])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=1200, help="per way, over all rounds")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    times = asyncio.run(measure(args.gap_ms / 1000, args.requests, args.rounds))
    base = statistics.median(times["back to back"])
    for way in WAYS:
        p50 = statistics.median(times[way])
        print(f"{way:>13}: p50 {p50 * 1e6:6.0f} µs  ({p50 / base:.2f}x back to back)")


if __name__ == "__main__":
    main()
