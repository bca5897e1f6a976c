"""One chat request as the engine renders it: the fields of vLLM 0.32's
``ChatCompletionRequest`` that change the prompt's token ids, with its defaults.

The gateway builds it from a chat body (``ChatPrompt.from_body``) or converts a
Responses or Anthropic Messages body into it (``kvindex.tokenization.responses``,
``kvindex.tokenization.anthropic``), as vLLM itself turns those into a chat
conversation; the local renderer renders it, the engine's ``/tokenize`` takes
``tokenize_body()``, and the token cache keys engine answers on that same body.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# pydantic's lax booleans (case does not matter; surrounding spaces do).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any) -> bool | None:
    """``value`` as pydantic's lax mode reads a boolean (so as vLLM reads its request
    fields): true/false, 0/1 (also 0.0/1.0), and the strings of ``_TRUE`` and
    ``_FALSE`` in any case; None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    return None


def lax_flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean field of the body as vLLM reads it; ``default`` when absent or not a
    boolean (the pod refuses such a request, so how it would have rendered is moot)."""
    value = lax_bool(body.get(name, default))
    return default if value is None else value


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of the template's own special tokens
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None  # for RAG templates
    reasoning_effort: str | None = None  # reaches the template, with enable_thinking

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ChatPrompt:
        """From an OpenAI chat completion body; absent or ill-typed fields take vLLM's
        defaults (the gateway has checked ``messages`` already)."""
        kwargs = body.get("chat_template_kwargs")
        tools = body.get("tools")
        documents = body.get("documents")
        effort = body.get("reasoning_effort")
        return cls(
            messages=body["messages"],
            add_generation_prompt=lax_flag(body, "add_generation_prompt", True),
            continue_final_message=lax_flag(body, "continue_final_message", False),
            add_special_tokens=lax_flag(body, "add_special_tokens", False),
            chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
            tools=tools if isinstance(tools, list) else None,
            documents=documents if isinstance(documents, list) else None,
            reasoning_effort=effort if isinstance(effort, str) else None,
        )

    def template_kwargs(self) -> dict[str, Any]:
        """The template's keyword arguments, merged as vLLM 0.32's ``build_chat_params``
        does: the request's ``chat_template_kwargs``, overridden by the generation
        flags, the documents and the reasoning effort when set (``None`` and
        ``"auto"`` never override); a reasoning effort also sets ``enable_thinking``
        (false for ``"none"``) unless the request's kwargs set it."""
        user = dict(self.chat_template_kwargs or {})
        extra: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "documents": self.documents,
            "reasoning_effort": self.reasoning_effort,
        }
        if self.reasoning_effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = self.reasoning_effort != "none"
        return user | {k: v for k, v in extra.items() if v is not None and v != "auto"}

    def tokenize_body(self) -> dict[str, Any]:
        """The engine's ``POST /tokenize`` body for this prompt, less ``model``
        (vLLM 0.32's ``TokenizeChatRequest``). It has no ``documents`` or
        ``reasoning_effort`` field: the effort goes in as the template kwargs it
        becomes, and a prompt's documents reach only the local renderer."""
        body: dict[str, Any] = {
            "messages": list(self.messages),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "add_special_tokens": self.add_special_tokens,
        }
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            merged = self.template_kwargs()
            for key in ("reasoning_effort", "enable_thinking"):
                if key in merged:
                    kwargs[key] = merged[key]
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if self.tools:
            body["tools"] = self.tools
        return body
