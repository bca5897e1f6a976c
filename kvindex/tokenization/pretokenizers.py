"""The byte-level BPE pre-tokenizers kvgate knows, found in a ``tokenizer.json``.

Two optimisations rest on knowing a tokenizer's word pattern: ``segments`` cuts long
pieces at seams that no pre-token crosses, and ``words`` looks plain ASCII pieces up
word by word. Both accept the same shapes, recognised here once: GPT-2's
``ByteLevel`` pre-tokenizer with its own regex, or a ``Split`` (isolated, not
inverted) on one of the patterns below before a ``ByteLevel`` without one.
"""

from __future__ import annotations

from typing import Any

# The byte-level pre-tokenizer's own regex (``use_regex``).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Split patterns, as in tokenizer.json.
LLAMA3 = (  # and the GPT-4 "cl100k" split
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (  # Qwen 2, 2.5 and 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = frozenset({LLAMA3, QWEN2, QWEN35})


def byte_level_pattern(pre: dict[str, Any] | None) -> str | None:
    """The word pattern of ``pre`` (a tokenizer.json ``pre_tokenizer``) when it is one
    of the known byte-level shapes; None otherwise."""
    pre = pre or {}
    if pre.get("type") == "ByteLevel":
        return GPT2 if pre.get("use_regex", True) else None
    members = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(members) != 2:
        return None
    split, byte_level = members
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
    ):
        return None
    pattern = (split.get("pattern") or {}).get("Regex")
    return pattern if pattern in _SPLITS else None


def adds_prefix_space(pre: dict[str, Any] | None) -> bool:
    """Whether a ``ByteLevel`` of ``pre`` prepends a space to each piece."""
    pre = pre or {}
    return any(n.get("add_prefix_space") for n in [pre, *(pre.get("pretokenizers") or [])])
