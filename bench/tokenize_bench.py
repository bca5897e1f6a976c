"""``kvgate bench tokenize``: what local tokenization costs, and what a long prompt
costs the requests beside it.

Three tables, on the tiny model's tokenizer (byte-level BPE, ChatML template):

* **costs**, median of ``repeats`` runs, one ``Tokenization`` as the gateway holds it:
  rendering a conversation of ``tokens`` tokens in 40 messages, encoding it whole
  (the transformers call vLLM's renderer makes), and through the segment cache when
  it is new, repeated, one turn longer, and a document of ``tokens`` tokens under a
  new question; then the block keys of that document's prompt, with nothing known
  and with its head known from an earlier question (``BlockKeyer``);
* **GIL**: the event loop's worst lag while a thread encodes the long prompt with
  ``Tokenizer.encode``, ``encode_batch``, the transformers call, and the segmented
  encoder: which of them let the loop run;
* **interference**, in one event loop as in the gateway: a short chat request
  arriving every 2 ms and tokenized (a cache hit), timed from its arrival (so the
  time it waited for the loop counts), in rounds that take turns: alone, and while
  ``tokens``-token prompts are tokenized back to back beside it, all new (their
  cache keeps nothing), through the segment cache or whole as before it. The
  difference in the short requests' time is what a long prompt adds to its
  neighbours;
* **new text**, µs per KB of text no segment cache holds, encoded whole by the Rust
  tokenizer and through the word cache (``kvindex/tokenization/words.py``), over
  the first and second half of each kind of text: the overhead benchmark's words,
  this repository's docs and Python source in 1 KB pieces, and random letters.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import string
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from bench.prompts import text_of_tokens
from bench.tinymodel import ensure_tokenizer
from kvindex.keyer import BlockKeyer
from kvindex.tokenization import ChatPrompt, LocalTokenizer, Tokenization
from kvindex.tokenization.segments import Segmenter

KEY_BLOCK = 16  # vLLM's default block size
SHORT = [{"role": "user", "content": "What is a prefix cache? Answer in one line."}]


@dataclass(frozen=True, slots=True)
class Interference:
    label: str
    short_requests: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    long_prompts: int


async def _ms(f: Callable[[], Awaitable[Any]], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        await f()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _conversation(tokens: int, seed: str) -> list[dict[str, str]]:
    text = text_of_tokens(tokens, seed=seed, tokenizer_dir=ensure_tokenizer())
    n = 40
    step = len(text) // n
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text[i * step : (i + 1) * step]}
        for i in range(n)
    ]


async def measure_costs(
    local: LocalTokenizer, tokens: int, repeats: int
) -> list[tuple[str, float]]:
    """(what, median ms) for rendering and every path of encoding a long prompt."""
    msgs = _conversation(tokens, "costs")
    prompt = ChatPrompt(msgs)
    text = local.render_chat(prompt)
    doc = text_of_tokens(tokens, seed="costs-doc", tokenizer_dir=ensure_tokenizer())

    async def render() -> None:
        local.render_chat(prompt)

    async def whole() -> None:
        local.encode(text, False)

    def fresh() -> Tokenization:
        return Tokenization("tiny", "local", local, offload_chars=10**9)  # all inline

    async def cold() -> None:
        await fresh().chat(prompt)

    warm, rag = fresh(), fresh()
    await warm.chat(prompt)
    await rag.chat(ChatPrompt([{"role": "user", "content": f"{doc}\n\nQuestion: first"}]))
    turns = iter(range(10**6))

    async def again() -> None:
        await warm.chat(prompt)

    async def next_turn() -> None:
        extra = [
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": f"Follow-up {next(turns)}: and the bounds?"},
        ]
        await warm.chat(ChatPrompt([*msgs, *extra]))

    async def question() -> None:
        content = f"{doc}\n\nQuestion: number {next(turns)}?"
        await rag.chat(ChatPrompt([{"role": "user", "content": content}]))

    doc_ids = await rag.chat(ChatPrompt([{"role": "user", "content": f"{doc}\n\nQuestion: x"}]))

    async def key_new() -> None:
        BlockKeyer("tiny", KEY_BLOCK).keys(doc_ids)  # a keyer of its own: nothing known

    keyer = BlockKeyer("tiny", KEY_BLOCK)
    keyer.keys(doc_ids[: len(doc_ids) - 8])  # the document under an earlier question

    async def key_known_head() -> None:
        keyer.keys(doc_ids)

    return [
        (f"render {len(msgs)} messages ({len(text):,} chars)", await _ms(render, repeats)),
        ("encode whole (transformers call)", await _ms(whole, repeats)),
        ("segmented, new prompt (cold cache)", await _ms(cold, repeats)),
        ("segmented, same prompt again", await _ms(again, repeats)),
        ("segmented, one more turn", await _ms(next_turn, repeats)),
        (f"segmented, {tokens:,}-token document, new question", await _ms(question, repeats)),
        (f"block keys of the document ({len(doc_ids) // KEY_BLOCK:,} blocks of {KEY_BLOCK}), "
         "none known", await _ms(key_new, repeats)),
        ("block keys of the document, its head known (an earlier question)",
         await _ms(key_known_head, repeats)),
    ]  # fmt: skip


def measure_gil(local: LocalTokenizer, tokens: int) -> list[tuple[str, float, float]]:
    """(how, encode ms, worst event-loop lag ms) with the encode in a worker thread."""
    text = local.render_chat(ChatPrompt(_conversation(tokens, "gil")))
    backend = local.backend
    tok = Tokenization("tiny", "local", local)
    inc = tok.incremental
    assert inc is not None
    ways: list[tuple[str, Callable[[], Any]]] = [
        ("Tokenizer.encode", lambda: backend.encode(text, add_special_tokens=False).ids),
        ("Tokenizer.encode_batch", lambda: backend.encode_batch([text], False)[0].ids),
        ("transformers __call__", lambda: local.encode(text, False)),
        ("segmented (encode_batch_fast)", lambda: inc.encode(inc.plan(text, False))),
    ]  # fmt: skip
    return [(name, *asyncio.run(_lag_during(f))) for name, f in ways]


async def _lag_during(work: Callable[[], Any], repeats: int = 5) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    worst = 0.0
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        fut = loop.run_in_executor(None, work)
        while not fut.done():
            due = loop.time() + 0.0005
            await asyncio.sleep(0.0005)
            worst = max(worst, loop.time() - due)
        await fut
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e3, worst * 1e3


MODES: tuple[str | None, ...] = (None, "segmented", "whole")


async def _interference(local: LocalTokenizer, tokens: int, seconds: float) -> list[Interference]:
    """Short requests every 2 ms, in rounds of 0.5 s that take turns (so a machine
    whose other load comes and goes weighs on every mode alike): alone, beside long
    prompts through the segment cache, and beside long prompts encoded whole (as
    without it). The long prompts' cache keeps nothing: each is encoded anew."""
    short = Tokenization("tiny", "local", local)
    await short.chat(ChatPrompt(SHORT))  # cached: the short request's own cost is a hit
    longs = {m: Tokenization("tiny", "local", local, cache_tokens=1) for m in MODES if m}
    longs["whole"].incremental = None
    doc = text_of_tokens(tokens, seed="interference", tokenizer_dir=ensure_tokenizer())
    samples: dict[str | None, list[float]] = {m: [] for m in MODES}
    done = dict.fromkeys(MODES, 0)
    loop = asyncio.get_running_loop()
    for _ in range(max(1, round(seconds / 0.5))):
        for mode in MODES:
            stop = loop.time() + 0.5

            async def long_prompts(
                tok: Tokenization, mode: str | None = mode, stop: float = stop
            ) -> None:
                while loop.time() < stop:
                    await tok.chat(ChatPrompt([{"role": "user", "content": doc}]))
                    done[mode] += 1

            background = asyncio.create_task(long_prompts(longs[mode])) if mode else None
            arrival = loop.time()
            while arrival < stop:
                arrival += 0.002  # arrivals on a fixed schedule, whatever the loop is doing
                await asyncio.sleep(max(0.0, arrival - loop.time()))
                await short.chat(ChatPrompt(SHORT))
                samples[mode].append(loop.time() - arrival)  # waiting for the loop, and work
            if background is not None:
                await background
    out = []
    for mode in MODES:
        s = sorted(samples[mode])
        label = f"beside {tokens:,}-token prompts ({mode})" if mode else "alone"
        out.append(Interference(
            label, len(s), statistics.median(s) * 1e3, s[int(len(s) * 0.99)] * 1e3,
            s[-1] * 1e3, done[mode],
        ))  # fmt: skip
    return out


def _pieces_of(paths: list[Path], limit: int = 600) -> list[str]:
    text = "".join(c for p in paths for c in p.read_text() if c.isascii())
    return [text[i : i + 1024] for i in range(0, len(text) - 1024, 1024)][:limit]


def measure_new_text() -> list[tuple[str, int, float, float, float]]:
    """(kind, pieces, whole µs/KB, word cache µs/KB first half, second half)."""
    from bench.overhead import _text

    root = Path(__file__).resolve().parent.parent
    rng = random.Random(0)
    letters = [" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                        for _ in range(180)) for _ in range(600)]  # fmt: skip
    kinds = {
        "the overhead benchmark's words": [_text(rng, 1024) for _ in range(600)],
        "docs/*.md": _pieces_of(sorted((root / "docs").glob("*.md"))),
        "gateway/*.py": _pieces_of(sorted((root / "gateway").glob("*.py"))),
        "random letters": letters,
    }
    backend = Tokenizer.from_file(str(ensure_tokenizer() / "tokenizer.json"))
    # as `kvgate serve` runs: a batch call of a few words on the rayon pool costs more
    # in waking its threads than in encoding
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return [_new_text_row(backend, kind, pieces) for kind, pieces in kinds.items()]
    finally:
        if parallelism is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism


def _new_text_row(
    backend: Tokenizer, kind: str, pieces: list[str]
) -> tuple[str, int, float, float, float]:
    whole = Segmenter.for_tokenizer(backend)
    whole.words = None
    cached = Segmenter.for_tokenizer(backend)
    started = time.perf_counter()
    for piece in pieces:
        whole.encode([piece])
    whole_us = (time.perf_counter() - started) / (sum(map(len, pieces)) / 1024) * 1e6
    halves = []
    for part in (pieces[: len(pieces) // 2], pieces[len(pieces) // 2 :]):
        started = time.perf_counter()
        for piece in part:
            cached.encode([piece])
        halves.append((time.perf_counter() - started) / (sum(map(len, part)) / 1024) * 1e6)
    return kind, len(pieces), whole_us, halves[0], halves[1]


def run_tokenize_bench(
    tokens: int = 32768, repeats: int = 5, seconds: float = 5.0, console: Console | None = None
) -> None:
    console = console or Console()
    local = LocalTokenizer(ensure_tokenizer())
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    costs = Table(title=f"Local tokenization, {tokens:,}-token prompts (median of {repeats})")
    costs.add_column("what")
    costs.add_column("ms", justify="right")
    for what, ms in asyncio.run(measure_costs(local, tokens, repeats)):
        costs.add_row(what, f"{ms:.2f}")
    console.print(costs)
    gil = Table(title=f"Encoding {tokens:,} tokens in a worker thread: does the loop run?")
    for col in ("how", "encode ms", "worst loop lag ms"):
        gil.add_column(col, justify="right" if col != "how" else "left")
    for how, ms, lag in measure_gil(local, tokens):
        gil.add_row(how, f"{ms:.1f}", f"{lag:.2f}")
    console.print(gil)
    table = Table(title=f"A short chat request every 2 ms, {seconds:g} s per row, one event loop")
    for col in ("short requests", "n", "p50 ms", "p99 ms", "max ms", "long prompts done"):
        table.add_column(col, justify="right" if col != "short requests" else "left")
    for r in asyncio.run(_interference(local, tokens, seconds)):
        table.add_row(r.label, str(r.short_requests), f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}",
                      f"{r.max_ms:.3f}", str(r.long_prompts))  # fmt: skip
    table.caption = f"load average {load} (1/5/15 min) at the start; {os.cpu_count()} CPUs"
    console.print(table)
    words = Table(title="New text, 1 KB pieces: µs per KB, whole and from the word cache")
    for col in ("text", "pieces", "whole", "word cache, 1st half", "2nd half"):
        words.add_column(col, justify="right" if col != "text" else "left")
    for kind, n, whole_us, first, second in measure_new_text():
        words.add_row(kind, str(n), f"{whole_us:.0f}", f"{first:.0f}", f"{second:.0f}")
    console.print(words)
