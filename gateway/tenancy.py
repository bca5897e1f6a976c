"""Tenant isolation of the KV cache: a per-tenant ``cache_salt`` on every request.

vLLM mixes ``cache_salt`` into the hash of a prompt's first block, so requests with
different salts never share cached blocks, and the gateway's block keys are seeded by
the same salt, so its index never tells one tenant what another has cached. Without
this, a tenant can confirm a guessed prefix of another tenant's prompt (a confidential
system prompt, a document) from how fast the first token comes back, or from the
index itself.

The salt is ``HMAC-SHA256(secret, tenant || 0x00 || client salt)``: a tenant cannot
compute another's, a client salt is namespaced by its tenant (two tenants sending the
same salt still do not share), and every replica with the same secret agrees.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

import msgspec

from gateway.auth import presented_key
from gateway.config import TenantIsolation
from gateway.openai_body import JSON, ParsedRequest

_SALT_HEX_CHARS = 32  # 128 bits


class Tenancy:
    """Rewrites each request's ``cache_salt`` for its tenant (no-op when disabled)."""

    def __init__(self, settings: TenantIsolation) -> None:
        self.enabled = settings.enabled
        self._source = settings.source
        self._header = settings.header.lower()
        self._secret = (settings.secret or "").encode()

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request: its API key, or the trusted header ("" if absent)."""
        if self._source == "api_key":
            return presented_key(headers) or ""
        return headers.get(self._header, "")

    def salt(self, tenant: str, client_salt: str | None) -> str:
        message = tenant.encode("utf-8", "surrogatepass") + b"\0"
        message += (client_salt or "").encode("utf-8", "surrogatepass")
        digest = hmac.new(self._secret, message, hashlib.sha256).hexdigest()
        return "t-" + digest[:_SALT_HEX_CHARS]

    def apply(self, parsed: ParsedRequest, headers: Mapping[str, str]) -> None:
        """Set the tenant's salt in the body the pod gets and in the one routing reads."""
        if not self.enabled or parsed.content_type != JSON:
            return  # a multipart form (audio) has no prefix cache to isolate
        client_salt = parsed.body.get("cache_salt")
        salt = self.salt(
            self.tenant(headers), client_salt if isinstance(client_salt, str) else None
        )
        parsed.raw = with_cache_salt(parsed.raw, parsed.body, salt)
        parsed.body["cache_salt"] = salt


def with_cache_salt(raw: bytes, body: Mapping[str, object], salt: str) -> bytes:
    """``raw`` (a JSON object) with ``cache_salt`` set to ``salt``.

    Without a salt in the body the field is spliced in after the opening brace, so
    every other byte the client sent goes upstream as it was; a body that has one is
    re-encoded with it replaced."""
    if "cache_salt" in body:
        return msgspec.json.encode({**body, "cache_salt": salt})
    start = raw.index(b"{") + 1
    member = b'"cache_salt":' + msgspec.json.encode(salt)
    return raw[:start] + member + (b"," if body else b"") + raw[start:]
