"""What tokenization costs a multi-turn conversation whose turns are spread over several
gateway processes (``--workers N``, or N replicas behind a Service): each process keeps
its own token and word caches, so a process that did not see the previous turns
encodes them too, and more new text per request crosses the offload threshold.

    python -m bench.tokenize_spread --workers 1,2,4 [--fixed-threshold] [--share]

The overhead benchmark's multi-turn bodies (``bench.overhead.Bodies``), each request
given to one of N ``Tokenization`` fronts at random; prints per N the CPU per request
(this process, worker threads included), the characters encoded per request and the
share of requests whose encoding went to a thread. ``--fixed-threshold`` sends every
text over 2,048 characters to a thread (the policy before ``offload.OffloadPolicy``).
``--share`` also prints each N with the fronts passing each other the prefixes of
conversations past their first turn, as sibling workers do over the host bus
(``gateway.siblings``' own message codec, ``PREFIX_TOKENS``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import time
from array import array

from bench.overhead import Bodies
from bench.tinymodel import ensure_tokenizer
from gateway.siblings import decode_prefix_tokens, encode_prefix_tokens
from kvindex.tokenization import ChatPrompt, LocalTokenizer, Tokenization
from kvindex.tokenization.offload import DEFAULT_MAX_CHARS, DEFAULT_MIN_CHARS


async def spread(
    workers: int, requests: int, fixed: bool, share: bool = False
) -> tuple[float, float, float]:
    """(CPU µs per request, characters encoded per request, share offloaded)."""
    local = LocalTokenizer(ensure_tokenizer())
    max_chars = DEFAULT_MIN_CHARS if fixed else DEFAULT_MAX_CHARS
    fronts = [Tokenization("tiny", "local", local, offload_max_chars=max_chars)
              for _ in range(workers)]  # fmt: skip
    if share:
        for front in fronts:
            front.on_prefix = functools.partial(_tell, [f for f in fronts if f is not front])
    bodies, rng = Bodies(8192, seed=3), random.Random(1)
    started = time.process_time()
    for _ in range(requests):
        body = json.loads(bodies.multi_turn())
        await rng.choice(fronts).chat(ChatPrompt.from_body(body))
    cpu = time.process_time() - started
    chars = sum(f.stats.encoded_chars for f in fronts)
    offloaded = sum(f.stats.offloaded for f in fronts)
    return cpu / requests * 1e6, chars / requests, offloaded / requests


def _tell(siblings: list[Tokenization], key: bytes, ids: array[int]) -> None:
    """What ``gateway.siblings`` does with a new prefix: encode it once, and each
    sibling decodes its own copy and keeps it."""
    payload = encode_prefix_tokens("tiny", bytes(8), key, ids)
    for sibling in siblings:
        _, _, key_there, ids_there = decode_prefix_tokens(payload)
        sibling.learn_prefix(key_there, ids_there)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--fixed-threshold", action="store_true")
    p.add_argument("--share", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `kvgate serve` sets it
    for n in (int(w) for w in args.workers.split(",")):
        for shared in (False, True) if args.share and n > 1 else (False,):
            us, chars, share = asyncio.run(spread(n, args.requests, args.fixed_threshold, shared))
            print(
                f"workers={n}{' sharing prefixes' if shared else ''}: {us:.0f} µs CPU/request, "
                f"{chars:,.0f} characters encoded/request, "
                f"{share:.0%} of requests encoded in a thread"
            )


if __name__ == "__main__":
    main()
