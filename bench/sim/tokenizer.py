"""Prompt tokenization exactly as vLLM 0.32 does it, and cheap fake output text.

vLLM (``vllm/renderers``): a chat request renders the template with
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` and
encodes the text with ``add_special_tokens=False`` (the request's
``add_special_tokens`` field, default False for chat); a completion prompt string
is encoded with ``add_special_tokens=True`` (default True for completions); a
prompt of token ids is used as is. Message content given as a list of text parts
is joined with newlines (the "string" content format).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_MAX_OUTPUT_VOCAB = 50_000  # candidates for fake output tokens; bounds start-up cost


class PromptError(ValueError):
    """A prompt the engine cannot take (shape or content), reported as HTTP 400."""


def _flatten_content(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
            texts.append(str(part.get("text", "")))
        else:
            raise PromptError("only text content parts are supported")
    return "\n".join(texts)


class SimTokenizer:
    """The pod's tokenizer: prompt → token ids once per request, ids → text."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        self._tok = AutoTokenizer.from_pretrained(str(self.path))
        self.vocab_size = len(self._tok)
        special = set(self._tok.all_special_ids) | set(self._tok.get_added_vocab().values())
        self._output_ids, self._output_text = self._output_table(special)

    def _output_table(self, special: set[int]) -> tuple[list[int], dict[int, str]]:
        """Token ids whose text stands alone (no special, no partial UTF-8).

        Pieces of such tokens concatenate to the decoded whole, so streaming
        deltas and the non-streamed text agree without incremental detokenizing.
        """
        ids = [i for i in range(min(self.vocab_size, _MAX_OUTPUT_VOCAB)) if i not in special]
        texts = self._tok.batch_decode([[i] for i in ids])
        table = {i: t for i, t in zip(ids, texts, strict=True) if t and "\ufffd" not in t}
        if not table:
            raise ValueError(f"tokenizer at {self.path} has no plain output tokens")
        return list(table), table

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        conversation = [{**m, "content": _flatten_content(m.get("content"))} for m in messages]
        try:
            text = self._tok.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except Exception as exc:  # template errors are the client's bad input
            raise PromptError(f"chat template failed: {type(exc).__name__}") from exc
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def encode_prompt(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """A completions ``prompt``: str, [str], [int, ...] or [[int, ...]]."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._tok.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if any(t < 0 or t >= self.vocab_size for t in prompt):
                raise PromptError(f"token id out of vocabulary (size {self.vocab_size})")
            return list(prompt)
        raise PromptError("prompt must be a string, a token id list, or a list of one of those")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def sample_output(self, rng: random.Random, n: int) -> list[int]:
        """``n`` pseudo-random plain token ids (never EOS, so generation runs to length)."""
        return rng.choices(self._output_ids, k=n)

    def piece(self, token_id: int) -> str:
        """Text of one sampled output token."""
        return self._output_text[token_id]
