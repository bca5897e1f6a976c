"""Reading a peer's HTTP answer whole, up to a size: what a pod sends the gateway besides
proxied answers (probes, ``/tokenize``) is read into memory and parsed, so a pod that
sends without end must not make the gateway hold without end."""

from __future__ import annotations

import asyncio

import httpx


class AnswerTooLarge(ValueError):
    """An answer longer than its caller allows."""


async def send_capped(
    client: httpx.AsyncClient, request: httpx.Request, max_bytes: int, timeout_s: float
) -> tuple[int, bytes]:
    """``request``'s status and body, read as it arrives (decoded: the cap counts what is
    kept) and refused past ``max_bytes`` with ``AnswerTooLarge``; ``TimeoutError`` past
    ``timeout_s`` in all (httpx's timeout is per read: a peer sending a byte at a time
    would hold the call for as long as it likes)."""
    async with asyncio.timeout(timeout_s):
        response = await client.send(request, stream=True)
        try:
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise AnswerTooLarge(f"{request.url.path} answer over {max_bytes} bytes")
            return response.status_code, bytes(body)
        finally:
            await response.aclose()
