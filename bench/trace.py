"""Mooncake-format trace replay: timestamps, lengths and shared-prefix hash ids.

Each trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`` where hash id i stands for the i-th 512-token block of the
prompt and two requests with the same leading hash ids share that prefix. We
rebuild that structure in text: one deterministic space-led text per hash id
(``tokens_per_hash`` tokens), concatenated and trimmed to the input length, so
requests that share hash-id prefixes share text (and token, and KV block)
prefixes. ``tokens_per_hash`` < 512 shrinks the whole trace proportionally for
small machines; ``speedup`` compresses time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import ChatRequest
from bench.prompts import filler_word, token_block
from bench.workloads import Workload

MOONCAKE_BLOCK_TOKENS = 512
# A Mooncake-format trace kept beside the repository on the project's machines (not
# shipped with it); KVGATE_TRACE or --trace names another.
DEFAULT_TRACE = Path(
    os.environ.get("KVGATE_TRACE", "/work/shared/data/mooncake_synthetic_trace.jsonl")
)


@dataclass(frozen=True, slots=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass
class TraceLoad:
    rows: list[TraceRow]
    skipped: int  # malformed lines: counted, never fatal


def _row(line: str) -> TraceRow | None:
    try:
        d = json.loads(line)
        row = TraceRow(
            float(d["timestamp"]),
            int(d["input_length"]),
            int(d["output_length"]),
            tuple(int(h) for h in d["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
    return row if row.input_length > 0 and row.output_length >= 0 else None


def load_trace(path: Path, limit: int | None = None) -> TraceLoad:
    """The first ``limit`` valid rows of a Mooncake JSONL trace."""
    rows: list[TraceRow] = []
    skipped = 0
    with path.open() as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            row = _row(line)
            if row is None:
                skipped += 1
            else:
                rows.append(row)
    return TraceLoad(rows, skipped)


def trace_prompt(
    row: TraceRow, tokens_per_hash: int, max_tokens: int, seed: int, tokenizer_dir: Path
) -> str:
    """Text of the row's (scaled, capped) input length built from its hash-id blocks."""
    target = min(max_tokens, max(1, row.input_length * tokens_per_hash // MOONCAKE_BLOCK_TOKENS))
    parts: list[str] = []
    have = 0
    for h in row.hash_ids:
        block = token_block(tokens_per_hash, f"trace-{seed}-{h}", tokenizer_dir)
        if have + block.tokens > target:
            parts.append(block.exact_head(target - have, filler_word(tokenizer_dir)))
            have = target
            break
        parts.append(block.text)
        have += block.tokens
    if have < target:  # hash ids cover less than input_length: pad deterministically
        parts.append(filler_word(tokenizer_dir) * (target - have))
    return "".join(parts)


def trace_workload(
    tokenizer_dir: Path,
    path: Path = DEFAULT_TRACE,
    requests: int | None = 200,
    speedup: float = 1.0,
    tokens_per_hash: int = MOONCAKE_BLOCK_TOKENS,
    max_input_tokens: int = 200_000,
    max_output_tokens: int = 64,
    seed: int = 0,
) -> Workload:
    """Replay the first ``requests`` rows at ``timestamp / speedup`` seconds."""
    load = load_trace(path, requests)
    t0 = load.rows[0].timestamp_ms if load.rows else 0.0
    sessions = []
    for i, row in enumerate(load.rows):
        text = trace_prompt(row, tokens_per_hash, max_input_tokens, seed, tokenizer_dir)
        req = ChatRequest(
            messages=[{"role": "user", "content": text}],
            max_tokens=max(1, min(row.output_length, max_output_tokens)),
            user=f"t{i}",
            at_s=(row.timestamp_ms - t0) / 1000.0 / speedup,
        )
        sessions.append([req])
    return Workload(
        "trace",
        sessions,
        timed=True,
        description=f"{path.name}: {len(load.rows)} requests ({load.skipped} bad lines skipped), "
        f"{tokens_per_hash} tokens per hash id, {speedup}x speed",
    )
