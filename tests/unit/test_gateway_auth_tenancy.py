"""Client keys (constant-time), tenant salts, and the settings that keep admin safe."""

import hmac
import json

import pytest
from pydantic import ValidationError

from gateway import auth
from gateway.config import Settings, TenantIsolation
from gateway.openai_body import parse_body
from gateway.tenancy import Tenancy, with_cache_salt


def test_a_key_is_compared_with_every_configured_key_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.key_matches("k1", ["k1", "k2", "k3"])  # found first, still compared to all
    assert [b for _, b in compared] == [b"k1", b"k2", b"k3"]
    assert not auth.key_matches("nope", ["k1", "k2"])
    assert not auth.key_matches(None, ["k1"])


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer sk-1", "sk-1"), ("bearer  sk-1 ", "sk-1"), ("Basic sk-1", None), ("", None),
     ("Bearer ", None)],
)  # fmt: skip
def test_bearer_token(header, token):
    assert auth.bearer_token({"authorization": header}) == token


def _tenancy(source: str = "api_key") -> Tenancy:
    return Tenancy(TenantIsolation(enabled=True, source=source, secret="s3cret"))


def test_salts_differ_per_tenant_and_namespace_a_client_salt():
    t = _tenancy()
    assert t.salt("sk-a", None) != t.salt("sk-b", None)
    assert t.salt("sk-a", "shared") != t.salt("sk-b", "shared")
    assert t.salt("sk-a", None) == _tenancy().salt("sk-a", None)  # every replica agrees
    other_secret = Tenancy(TenantIsolation(enabled=True, secret="other"))
    assert other_secret.salt("sk-a", None) != t.salt("sk-a", None)
    assert t.salt("sk-a", None).startswith("t-") and len(t.salt("sk-a", None)) == 34


def test_the_salt_is_spliced_in_and_every_other_byte_kept():
    raw = b'  {"model":"m","prompt":"hi",  "x": 1.50}'
    parsed = parse_body(raw, "completions")
    _tenancy().apply(parsed, {"authorization": "Bearer sk-a"})
    salt = _tenancy().salt("sk-a", None)
    assert (
        parsed.raw
        == b'  {"cache_salt":"' + salt.encode() + b'","model":"m","prompt":"hi",  "x": 1.50}'
    )
    assert parsed.body["cache_salt"] == salt and json.loads(parsed.raw)["x"] == 1.5


def test_a_clients_own_salt_is_replaced_by_its_tenants():
    parsed = parse_body(b'{"model":"m","prompt":"hi","cache_salt":"mine"}', "completions")
    _tenancy("header").apply(parsed, {"x-tenant-id": "team-7"})
    expected = _tenancy("header").salt("team-7", "mine")
    assert json.loads(parsed.raw) == {"model": "m", "prompt": "hi", "cache_salt": expected}


def test_with_cache_salt_on_an_empty_object():
    assert with_cache_salt(b"{}", {}, "s") == b'{"cache_salt":"s"}'


def test_disabled_tenancy_leaves_the_body_alone():
    parsed = parse_body(b'{"model":"m","prompt":"hi"}', "completions")
    Tenancy(TenantIsolation()).apply(parsed, {"authorization": "Bearer sk-a"})
    assert parsed.raw == b'{"model":"m","prompt":"hi"}' and "cache_salt" not in parsed.body


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"admin": {"host": "0.0.0.0"}}, "reachable from the network"),
        ({"admin": {"port": 8000}}, "must differ"),
        ({"api_keys": ["k"], "admin": {"api_keys": ["k"]}}, "must not also be a client key"),
        ({"tenant_isolation": {"enabled": True}}, "needs tenant_isolation.secret"),
        ({"tenant_isolation": {"enabled": True, "secret": "s"}}, "needs api_keys"),
        ({"timeouts": {"first_byte_s": 10, "total_s": 5}}, "must not exceed"),
    ],
)
def test_unsafe_or_contradictory_settings_fail_at_start_up(fields, message):
    with pytest.raises(ValidationError, match=message):
        Settings(**fields)


def test_an_admin_listener_off_loopback_is_fine_with_admin_keys():
    s = Settings(admin={"host": "0.0.0.0", "api_keys": "adm-1,adm-2"})
    assert s.admin.api_keys == ["adm-1", "adm-2"]
