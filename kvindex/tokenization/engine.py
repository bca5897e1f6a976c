"""Ask a pod for token ids: vLLM's ``POST /tokenize`` (chat template applied there).

Request bodies mirror vLLM 0.32's ``TokenizeChatRequest`` (``ChatPrompt.tokenize_body``)
and ``TokenizeCompletionRequest`` (``prompt``, ``add_special_tokens``); the answer's
``tokens`` are the engine's own ids.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec

from kvindex.bounded_http import AnswerTooLarge, send_capped
from kvindex.keyer import is_token_id
from kvindex.tokenization.prompt import ChatPrompt


class EngineTokenizeError(RuntimeError):
    """The pod did not return token ids (unreachable, non-200, bad body)."""


# What a pod's answer may hold, from what it was asked: every token takes at least one
# byte of the text (byte-level BPE at most one per byte), and the request's JSON is no
# shorter than its text; the chat template adds its tokens on top.
TEMPLATE_TOKENS = 4096
ID_JSON_BYTES = 11  # "4294967295," : the longest id in the answer's list
ANSWER_JSON_BYTES = 4096  # the rest of the answer: count, max_model_len, token strings off
_answer = msgspec.json.Decoder()


class EngineTokenizer:
    def __init__(
        self,
        base_url: str,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 5.0,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = client if client is not None else httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self._timeout_s = timeout_s  # per call, also on a shared client (whose default is long)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def chat(self, model: str, prompt: ChatPrompt) -> list[int]:
        return await self._tokenize({"model": model, **prompt.tokenize_body()})

    async def completion(
        self, model: str, prompt: str, add_special_tokens: bool = True
    ) -> list[int]:
        body = {"model": model, "prompt": prompt, "add_special_tokens": add_special_tokens}
        return await self._tokenize(body)

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        content = json.dumps(body).encode()
        max_tokens = len(content) + TEMPLATE_TOKENS
        request = self._client.build_request(
            "POST", f"{self.base_url}/tokenize", content=content, timeout=self._timeout_s,
            headers={**self._headers, "content-type": "application/json"},
        )  # fmt: skip
        max_bytes = max_tokens * ID_JSON_BYTES + ANSWER_JSON_BYTES
        try:
            # in all, so that a pod dripping its answer cannot hold the request it serves
            status, answer = await send_capped(self._client, request, max_bytes, self._timeout_s)
        except httpx.HTTPError as exc:
            raise EngineTokenizeError(f"/tokenize unreachable: {type(exc).__name__}") from None
        except TimeoutError:
            raise EngineTokenizeError(f"/tokenize took over {self._timeout_s:g} s") from None
        except AnswerTooLarge as exc:
            raise EngineTokenizeError(str(exc)) from None
        if status != 200:
            raise EngineTokenizeError(f"/tokenize answered {status}")
        try:
            tokens = _answer.decode(answer)["tokens"]
        except (msgspec.DecodeError, RecursionError, KeyError, TypeError):
            raise EngineTokenizeError("/tokenize body has no tokens") from None
        if not isinstance(tokens, list) or len(tokens) > max_tokens:
            raise EngineTokenizeError("/tokenize tokens are not a list the prompt could make")
        if not all(is_token_id(t) for t in tokens):
            raise EngineTokenizeError("/tokenize tokens are not ids in [0, 2^32)")
        return tokens

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
