"""Tokenization that matches the engine: local chat rendering, the pod's /tokenize, a cache,
and the conversions vLLM applies to Responses and Anthropic Messages requests."""

from kvindex.tokenization.anthropic import AnthropicFacts, messages_prompt
from kvindex.tokenization.engine import EngineTokenizeError, EngineTokenizer
from kvindex.tokenization.errors import UnsupportedPrompt
from kvindex.tokenization.front import Mode, TokenCache, Tokenization, TokenizationError
from kvindex.tokenization.local import LocalTokenizer
from kvindex.tokenization.prompt import ChatPrompt
from kvindex.tokenization.responses import responses_prompt

__all__ = [
    "AnthropicFacts",
    "ChatPrompt",
    "EngineTokenizeError",
    "EngineTokenizer",
    "LocalTokenizer",
    "Mode",
    "TokenCache",
    "Tokenization",
    "TokenizationError",
    "UnsupportedPrompt",
    "messages_prompt",
    "responses_prompt",
]
