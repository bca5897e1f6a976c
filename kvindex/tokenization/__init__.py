"""Tokenization that matches the engine: local chat rendering, the pod's /tokenize, a cache."""

from kvindex.tokenization.engine import EngineTokenizeError, EngineTokenizer
from kvindex.tokenization.front import Mode, TokenCache, Tokenization, TokenizationError
from kvindex.tokenization.local import LocalTokenizer, UnsupportedPrompt

__all__ = [
    "EngineTokenizeError",
    "EngineTokenizer",
    "LocalTokenizer",
    "Mode",
    "TokenCache",
    "Tokenization",
    "TokenizationError",
    "UnsupportedPrompt",
]
