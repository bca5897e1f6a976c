"""Reading a peer's HTTP answer whole, up to a size: what a pod sends the gateway besides
proxied answers (probes, ``/tokenize``) is read into memory and parsed, so a pod that
sends without end must not make the gateway hold without end."""

from __future__ import annotations

import httpx


class AnswerTooLarge(ValueError):
    """An answer longer than its caller allows."""


async def send_capped(
    client: httpx.AsyncClient, request: httpx.Request, max_bytes: int
) -> tuple[int, bytes]:
    """``request``'s status and body, read as it arrives (decoded: the cap counts what is
    kept) and refused past ``max_bytes`` with ``AnswerTooLarge``. The caller bounds the
    time: httpx's timeout is per read."""
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
