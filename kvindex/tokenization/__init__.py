"""Tokenization that matches the engine: local chat rendering, the pod's /tokenize, a cache."""

from kvindex.tokenization.engine import EngineTokenizeError, EngineTokenizer
from kvindex.tokenization.front import Mode, TokenCache, Tokenization, TokenizationError
from kvindex.tokenization.local import LocalTokenizer, UnsupportedPrompt
from kvindex.tokenization.prompt import ChatPrompt

__all__ = [
    "ChatPrompt",
    "EngineTokenizeError",
    "EngineTokenizer",
    "LocalTokenizer",
    "Mode",
    "TokenCache",
    "Tokenization",
    "TokenizationError",
    "UnsupportedPrompt",
]
