"""Offline tokenizer that renders chat exactly as vLLM 0.32 does.

vLLM 0.32 (``vllm/renderers/hf.py: safe_apply_chat_template``) calls
``tokenizer.apply_chat_template(conversation, tools=..., chat_template=...,
tokenize=True, return_dict=False, **template kwargs)``; with ``tokenize=True``
transformers renders the template and encodes the text with
``add_special_tokens=False``. Chat requests may set ``add_special_tokens`` (default
False) on top. Completions encode the prompt with ``add_special_tokens=True`` unless
the request says otherwise (``CompletionRequest.add_special_tokens``). We render
(``tokenize=False``) and encode in two steps, which gives the same ids and lets the
cache key on the rendered text.

Rendering goes straight to the template transformers compiles (``_render_direct``)
when ``apply_chat_template``'s preparation of the messages could not change them:
its cost (copying every message twice into plain data) was half of a long
conversation's rendering. Anything else takes ``apply_chat_template`` itself.

Before rendering, messages become the conversation vLLM builds for text-only chat
(``kvindex.tokenization.conversation``: content format, kept keys, tool-call
arguments, developer turns) and tools the dicts vLLM dumps; the template kwargs are
merged like vLLM's (``ChatPrompt.template_kwargs``). Anything else (images, audio,
...) raises ``UnsupportedPrompt``: ask the engine.

Two facts about the template decide how vLLM converts Anthropic Messages requests,
and are probed here as vLLM probes them, once per tokenizer (``AnthropicFacts``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from kvindex.tokenization.anthropic import AnthropicFacts, merges_inline_system
from kvindex.tokenization.conversation import (
    build_conversation,
    knows_developer_role,
    normalize_tools,
)
from kvindex.tokenization.errors import UnsupportedPrompt
from kvindex.tokenization.prompt import ChatPrompt

__all__ = ["LocalTokenizer", "UnsupportedPrompt"]

# chat_template_kwargs vLLM refuses (they would override its own arguments)
_RESERVED_KWARGS = frozenset({"tokenize", "chat_template", "conversation", "messages", "tools"})
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+[\w\.\[\]'\"]*content")
# vLLM's candidates when it probes what thinking.type=disabled should map to.
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Names transformers copies a message's reasoning under before rendering (5.x).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_compiler() -> Callable[[str], Any] | None:
    """transformers' own (cached) compiler of chat templates: the sandboxed Jinja
    environment with its filters and globals. None where this transformers lacks it."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - present since transformers 4.43
        return None
    return _compile_jinja_template


def _plain_conversation(conversation: list[dict[str, Any]]) -> bool:
    """Whether ``apply_chat_template`` would hand the template these very messages:
    it drops keys whose value is None, copies reasoning under its other names and
    rebuilds everything as plain data (a conversation built from decoded JSON
    already is)."""
    if not conversation:
        return False  # transformers refuses an empty conversation
    for message in conversation:
        if None in message.values() or any(k in message for k in _REASONING_FIELDS):
            return False
    return True


class LocalTokenizer:
    """A Hugging Face tokenizer (tokenizer.json + chat template) loaded offline."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer  # heavy import: only when used

        self.path = str(path)
        self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self._override = chat_template  # like vLLM's --chat-template; None: the tokenizer's
        self._compile = _template_compiler()

    @property
    def backend(self) -> Any:
        """The Rust ``tokenizers.Tokenizer`` under the HF tokenizer (None for a slow one)."""
        return getattr(self._tok, "backend_tokenizer", None)

    def template_for(self, tools: list[dict[str, Any]] | None = None) -> str:
        """The template vLLM resolves: the override, else the tokenizer's (tool_use with tools)."""
        try:
            template = self._tok.get_chat_template(self._override, tools=tools)
        except (ValueError, KeyError, TypeError):
            raise UnsupportedPrompt("tokenizer has no chat template") from None
        if not isinstance(template, str):
            raise UnsupportedPrompt("tokenizer has no chat template")
        return template

    def render_chat(self, prompt: ChatPrompt) -> str:
        """The prompt text the engine's template produces for this request (before
        ``prompt.add_special_tokens``, which applies when the text is encoded)."""
        tools = normalize_tools(prompt.tools)
        template = self.template_for(tools)
        if prompt.add_generation_prompt and prompt.continue_final_message:
            raise UnsupportedPrompt("add_generation_prompt and continue_final_message both set")
        kwargs = {k: v for k, v in prompt.template_kwargs().items() if k not in _RESERVED_KWARGS}
        conversation = build_conversation(
            prompt.messages,
            openai_content=bool(_CONTENT_LOOP.search(template)),
            knows_developer=knows_developer_role(template),
        )
        try:
            rendered = self._render_direct(conversation, tools, template, kwargs)
            if rendered is None:
                rendered = self._tok.apply_chat_template(
                    conversation, tools=tools, chat_template=template, tokenize=False, **kwargs
                )
        except Exception as exc:  # template errors are the request's problem, not ours
            raise UnsupportedPrompt(f"chat template failed: {type(exc).__name__}") from None
        if not isinstance(rendered, str):
            raise UnsupportedPrompt("chat template did not render to text")
        return rendered

    def _render_direct(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        kwargs: dict[str, Any],
    ) -> str | None:
        """The template rendered as ``apply_chat_template(tokenize=False)`` renders it,
        without its preparation of the messages; None where that preparation could
        change what the template sees (see ``_plain_conversation``), where the final
        message is continued (transformers trims the text after it) or where
        documents are given (transformers checks them)."""
        if self._compile is None or not _plain_conversation(conversation):
            return None
        kwargs = dict(kwargs)
        add_generation_prompt = kwargs.pop("add_generation_prompt", False)
        if kwargs.pop("continue_final_message", False) or "documents" in kwargs:
            return None
        variables = {**self._special_tokens, **kwargs}  # as transformers merges them
        return self._compile(template).render(
            messages=conversation,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    @cached_property
    def _special_tokens(self) -> dict[str, Any]:
        """The special tokens every template sees (``bos_token``, ``eos_token`` ...)."""
        return dict(self._tok.special_tokens_map)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (CPU-bound: ~0.6 µs per character on a 2-core VM)."""
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    @cached_property
    def anthropic_facts(self) -> AnthropicFacts:
        """What vLLM's Messages endpoint learns from this template at start-up."""
        templates = []
        for tools in (None, []):  # vLLM checks the plain and the tool-use template
            try:
                templates.append(self.template_for(tools))
            except UnsupportedPrompt:
                templates.append(None)
        merge = any(merges_inline_system(t) for t in templates)
        return AnthropicFacts(merge, self._disabled_thinking_effort())

    def _disabled_thinking_effort(self) -> str:
        """vLLM's probe: ``"none"`` unless the template rejects it or renders it like
        some thinking effort (then ``"low"``)."""

        def render(effort: str) -> str | None:
            prompt = ChatPrompt([{"role": "user", "content": "Hi"}], reasoning_effort=effort)
            try:
                return self.render_chat(prompt)
            except UnsupportedPrompt:
                return None

        none = render("none")
        if none is None or any(render(e) == none for e in _EFFORTS):
            return "low"
        return "none"
