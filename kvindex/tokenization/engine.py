"""Ask a pod for token ids: vLLM's ``POST /tokenize`` (chat template applied there).

Request bodies mirror vLLM 0.32's ``TokenizeChatRequest`` (``ChatPrompt.tokenize_body``)
and ``TokenizeCompletionRequest`` (``prompt``, ``add_special_tokens``); the answer's
``tokens`` are the engine's own ids.
"""

from __future__ import annotations

from typing import Any

import httpx

from kvindex.tokenization.prompt import ChatPrompt


class EngineTokenizeError(RuntimeError):
    """The pod did not return token ids (unreachable, non-200, bad body)."""


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
        try:
            resp = await self._client.post(
                f"{self.base_url}/tokenize", json=body, headers=self._headers,
                timeout=self._timeout_s,
            )  # fmt: skip
        except httpx.HTTPError as exc:
            raise EngineTokenizeError(f"/tokenize unreachable: {type(exc).__name__}") from None
        if resp.status_code != 200:
            raise EngineTokenizeError(f"/tokenize answered {resp.status_code}")
        try:
            tokens = resp.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            raise EngineTokenizeError("/tokenize body has no tokens") from None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise EngineTokenizeError("/tokenize tokens are not integers")
        return tokens

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
