"""Chained chunk hashes of a rendered prompt, for the approximate prefix-aware router.

The prefix-aware strategy needs no tokenizer and no KV events: it cuts the rendered
prompt into fixed-size character chunks and chains xxh3-64 hashes over them, so
hash ``i`` stands for the whole prefix ``chunks[0..i]``. Two prompts that share their
first ``k`` chunks share their first ``k`` hashes and nothing after.

Only the hashes leave this module; the text is never stored (house rule). For chat,
each message is rendered as role + name + content with control-character separators
that ordinary text does not contain, so ``[user: "ab"]`` and ``[user: "a", "b"]``
differ and a tool message does not collide with a user message of the same text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

DEFAULT_CHUNK_CHARS = 256  # ~64 tokens of English; ~4 vLLM blocks of 16
DEFAULT_MAX_CHUNKS = 512  # caps work and LRU pressure from one huge prompt (128k chars)

_FIELD = "\x1f"  # unit separator: between role, name and content
_RECORD = "\x1e"  # record separator: after each message
_PART = "\x1d"  # group separator: between content parts / token ids


def prefix_hashes(
    text: str,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    seed: int = 0,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
) -> list[int]:
    """Chained xxh3-64 hashes over ``chunk_chars``-character chunks of ``text``.

    The trailing partial chunk is hashed too, so an exact repeat matches in full;
    ``seed`` separates hash spaces (e.g. per model). At most ``max_chunks`` hashes.
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    out: list[int] = []
    h = seed & 0xFFFFFFFFFFFFFFFF
    hash_fn = xxhash.xxh3_64_intdigest
    end = min(len(text), chunk_chars * max_chunks)
    for start in range(0, end, chunk_chars):
        chunk = text[start : start + chunk_chars]
        # surrogatepass: JSON bodies may carry lone surrogates; they must hash, not fail.
        h = hash_fn(chunk.encode("utf-8", "surrogatepass"), h)
        out.append(h)
    return out


def text_prefix_hashes(
    prompt: Any,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    seed: int = 0,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
) -> list[int]:
    """Hashes of an OpenAI completions ``prompt``: a string, token ids or a list of strings.

    Anything else (bad input) yields ``[]``: the router then falls back to load.
    """
    rendered = _render_prompt(prompt)
    if rendered is None:
        return []
    return prefix_hashes(rendered, chunk_chars, seed, max_chunks)


def chat_prefix_hashes(
    messages: Any,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    seed: int = 0,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
) -> list[int]:
    """Hashes of OpenAI chat ``messages`` (role, name and content of each message).

    Messages that are not objects are skipped; a non-list yields ``[]``.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        return []
    rendered = "".join(_render_message(m) for m in messages if isinstance(m, Mapping))
    return prefix_hashes(rendered, chunk_chars, seed, max_chunks)


def _render_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return _PART.join(map(str, prompt))
        if all(isinstance(s, str) for s in prompt):
            return _RECORD.join(prompt)
    return None


def _render_message(msg: Mapping[str, Any]) -> str:
    role = msg.get("role")
    name = msg.get("name")
    parts = [
        role if isinstance(role, str) else "",
        name if isinstance(name, str) else "",
        _render_content(msg.get("content")),
    ]
    tool_calls = msg.get("tool_calls")
    if tool_calls:
        parts.append(_stable_json(tool_calls))
    return _FIELD.join(parts) + _RECORD


def _render_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable) and not isinstance(content, bytes | Mapping):
        return _PART.join(_render_part(p) for p in content)
    return _stable_json(content)


def _render_part(part: Any) -> str:
    # Text parts hash by their text; images/audio by their JSON (URL or data), so two
    # prompts that differ only in an image do not look like the same prefix.
    if isinstance(part, Mapping) and part.get("type") == "text":
        text = part.get("text")
        return text if isinstance(text, str) else ""
    if isinstance(part, str):
        return part
    return _stable_json(part)


def _stable_json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    except (TypeError, ValueError, RecursionError):  # circular or too deep: its type only
        return type(value).__name__
