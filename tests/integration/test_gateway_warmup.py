"""Local tokenizers load before the gateway serves, not on the first request.

Loaded lazily, the first kv-aware request paid the transformers import and the
tokenizer load (~1-2 s) on the event loop, stalling every request in flight: it
showed as a ~1.4 s TTFT p99 for kv-aware in the fleet benchmark."""

from __future__ import annotations

import pytest

from bench.tinymodel import ensure_tokenizer
from gateway.app import create_app
from gateway.config import Settings


@pytest.mark.parametrize(("strategy", "warmed"), [("kv-aware", True), ("round-robin", False)])
async def test_configured_tokenizers_are_loaded_at_start_up_when_the_strategy_uses_them(
    strategy: str, warmed: bool
) -> None:
    settings = Settings(
        strategy=strategy,
        models={"tiny": {"tokenizer": str(ensure_tokenizer()), "block_size": 32}},
    )
    app = create_app(settings)

    async with app.router.lifespan_context(app):
        kv = app.state.gw.kv
        loaded = "tiny" in kv.tokens._local  # noqa: SLF001  (what the first request would do)
        assert loaded is warmed
        if warmed:
            assert kv.tokens.tokenization("tiny").local is not None


async def test_a_tokenizer_that_does_not_load_is_logged_and_start_up_goes_on(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(strategy="kv-aware", models={"broken": {"tokenizer": str(tmp_path)}})
    app = create_app(settings)

    async with app.router.lifespan_context(app):
        assert app.state.gw.kv is not None

    assert "tokenizer for broken did not load" in caplog.text
