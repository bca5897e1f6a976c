"""One chat request as the engine renders it: the fields of vLLM 0.32's
``ChatCompletionRequest`` that change the prompt's token ids, with its defaults.

The gateway builds it from the request body (``ChatPrompt.from_body``); the local
renderer renders it, the engine's ``/tokenize`` takes ``tokenize_body()``, and the
token cache keys engine answers on that same body.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of the template's own special tokens
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None  # for RAG templates

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ChatPrompt:
        """From an OpenAI chat completion body; absent or ill-typed fields take vLLM's
        defaults (the gateway has checked ``messages`` already)."""
        kwargs = body.get("chat_template_kwargs")
        tools = body.get("tools")
        documents = body.get("documents")
        return cls(
            messages=body["messages"],
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            add_special_tokens=bool(body.get("add_special_tokens", False)),
            chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
            tools=tools if isinstance(tools, list) else None,
            documents=documents if isinstance(documents, list) else None,
        )

    def tokenize_body(self) -> dict[str, Any]:
        """The engine's ``POST /tokenize`` body for this prompt, less ``model``
        (vLLM 0.32's ``TokenizeChatRequest``). It has no ``documents`` field, so a
        prompt's documents reach only the local renderer."""
        body: dict[str, Any] = {
            "messages": list(self.messages),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "add_special_tokens": self.add_special_tokens,
        }
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if self.tools:
            body["tools"] = self.tools
        return body
