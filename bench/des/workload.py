"""DES workloads: Mooncake traces (hash ids as prompts), Poisson arrivals, chat requests.

Mooncake format, one JSON object per line: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (one id per 512-token block; equal ids at equal
positions mean equal prefixes). No tokenizer is involved: each hash id stands for
one 512-token block and the block keys are chained over the ids with the router's
own xxh3 chaining (``kvindex.keyer.chain_packed``), so a key still identifies the
whole prefix up to its block, as the gateway's keys do.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.des.types import DesRequest
from kvindex.keyer import chain_packed, pack_tokens, root_key

log = logging.getLogger(__name__)
MOONCAKE_BLOCK_TOKENS = 512


def mooncake_keys(hash_ids: Sequence[int], n_blocks: int, model: str = "mooncake") -> list[int]:
    """Chained router keys for the first ``n_blocks`` hash ids (each id one block)."""
    if n_blocks <= 0:
        return []
    return chain_packed(root_key(model), pack_tokens(hash_ids[:n_blocks]), 1, n_blocks)


def _parse(line: str) -> tuple[float, int, int, list[int]] | None:
    try:
        row: dict[str, Any] = json.loads(line)
        ids = [int(x) for x in row["hash_ids"]]
        return (
            float(row["timestamp"]) / 1000.0,
            int(row["input_length"]),
            int(row["output_length"]),
            ids,
        )
    except (ValueError, KeyError, TypeError):
        return None


def load_mooncake(
    path: Path,
    *,
    time_scale: float = 1.0,
    repeat: int = 1,
    limit: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[DesRequest]:
    """Requests of a Mooncake trace; bad lines are counted, logged once and skipped.

    ``time_scale`` stretches inter-arrival times (2.0 = half the rate). ``repeat``
    plays the trace again after itself with hash ids shifted out of the range used
    so far, so a repeat adds load with the same shape but no artificial reuse.
    """
    rows = []
    bad = 0
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                parsed = _parse(line)
                if parsed is None:
                    bad += 1
                else:
                    rows.append(parsed)
            if limit is not None and len(rows) >= limit:
                break
    if bad:
        log.warning("%s: %d malformed lines skipped", path, bad)
    if not rows:
        return []
    span = max(r[0] for r in rows) + 1.0
    id_span = max((max(r[3]) for r in rows if r[3]), default=0) + 1
    out: list[DesRequest] = []
    for rep in range(max(1, repeat)):
        for ts, n_in, n_out, ids in rows:
            shifted = [i + rep * id_span for i in ids] if rep else ids
            n_blocks = min(len(shifted), n_in // block_tokens)
            out.append(
                DesRequest(
                    arrival_s=(ts + rep * span) * time_scale,
                    prompt_tokens=n_in,
                    output_tokens=max(1, n_out),
                    block_keys=mooncake_keys(shifted, n_blocks),
                )
            )
    return out


def poisson_arrivals(
    requests: Sequence[DesRequest], rate: float, seed: int = 0
) -> list[DesRequest]:
    """The same requests in order, re-timed as a Poisson process of ``rate`` per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for r in requests:
        t += rng.expovariate(rate)
        out.append(DesRequest(t, r.prompt_tokens, r.output_tokens, r.block_keys, r.session))
    return out


def chat_to_des(
    messages_list: Sequence[Sequence[dict[str, str]]],
    output_tokens: Sequence[int],
    arrivals: Sequence[float],
    tokenizer_dir: Path,
    model: str,
    block_size: int,
) -> list[DesRequest]:
    """Chat requests as the gateway sees them: the pod's chat template, then its keys.

    Token ids are rendered exactly as the simulated pod renders them (template as
    text, then encoded without special tokens), and keyed with the gateway's
    ``BlockKeyer`` for ``model``.
    """
    from transformers import AutoTokenizer

    from kvindex.keyer import BlockKeyer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    keyer = BlockKeyer(model, block_size)
    out = []
    for messages, n_out, at in zip(messages_list, output_tokens, arrivals, strict=True):
        text = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        out.append(DesRequest(at, len(ids), n_out, keyer.keys(ids)))
    return out
