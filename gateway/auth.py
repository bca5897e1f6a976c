"""Who may call the gateway: client API keys, checked before a request is handled.

Keys are compared in constant time (``hmac.compare_digest`` against every configured
key, without stopping at the first match), so response timing tells an attacker
nothing about how much of a guessed key was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from gateway.errors import GatewayError


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if there is one."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The client's key: a bearer token, else ``x-api-key`` (what Anthropic's clients send)."""
    return bearer_token(headers) or headers.get("x-api-key") or None


def key_matches(token: str | None, keys: Sequence[str]) -> bool:
    """Whether ``token`` is one of ``keys``, in time independent of where it differs."""
    if not token:  # no key, or an empty one: never a match (not even an empty key)
        return False
    presented = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key.encode())
    return found


def require_client_key(headers: Mapping[str, str], keys: Sequence[str]) -> None:
    """Raise 401 unless the request carries one of ``keys`` (no keys: open gateway)."""
    if keys and not key_matches(presented_key(headers), keys):
        raise GatewayError(401, "missing or invalid API key for this gateway",
                           code="invalid_api_key")  # fmt: skip
