"""The inference APIs the gateway serves: where each lives, how it is parsed and routed,
and the shape its errors take.

Generation APIs whose prompt the gateway can render the way vLLM does (chat,
completions, Responses, Anthropic Messages) are routed by what the pods have cached;
the rest (embeddings, pooling, scoring, audio, tokenizer endpoints) are passed through
to a pod serving the model, chosen by load alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import ErrorStyle
from gateway.openai_body import Kind


@dataclass(frozen=True, slots=True)
class Api:
    path: str
    kind: Kind


APIS: tuple[Api, ...] = (
    Api("/v1/chat/completions", "chat"),
    Api("/v1/completions", "completions"),
    Api("/v1/responses", "responses"),
    Api("/v1/messages", "messages"),
    Api("/v1/messages/count_tokens", "messages_count"),
    Api("/v1/embeddings", "embeddings"),
    Api("/tokenize", "tokenize"),
    Api("/detokenize", "detokenize"),
    Api("/pooling", "pooling"),
    Api("/classify", "classify"),
    Api("/v1/score", "score"),
    Api("/score", "score"),
    Api("/v1/rerank", "rerank"),
    Api("/rerank", "rerank"),
    Api("/v2/rerank", "rerank"),
    Api("/v1/audio/transcriptions", "audio"),
    Api("/v1/audio/translations", "audio"),
)

# Kinds whose prompt is tokenized like the engine and looked up in the KV index.
CACHE_ROUTED: frozenset[Kind] = frozenset({"chat", "completions", "responses", "messages"})


def error_style(kind: Kind) -> ErrorStyle:
    """Anthropic's error shape for its endpoints, OpenAI's for the rest."""
    return "anthropic" if kind in ("messages", "messages_count") else "openai"
