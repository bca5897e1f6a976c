"""gateway.logs.ThrottledError: a failing background loop logs its traceback at most
once per interval, and at DEBUG in between."""

from __future__ import annotations

import logging

import pytest

from gateway.logs import ThrottledError


def test_a_repeated_failure_logs_its_traceback_once_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("gateway.logs.time.monotonic", lambda: now[0])
    log_it = ThrottledError(logging.getLogger("test.throttled"), "loop failed", every_s=60.0)
    with caplog.at_level(logging.DEBUG, logger="test.throttled"):
        log_it(ValueError("first"))
        now[0] += 59.0
        log_it(ValueError("second"))
        now[0] += 1.0
        log_it(ValueError("third"))
    levels = [(r.levelno, r.exc_info is not None) for r in caplog.records]
    assert levels == [(logging.ERROR, True), (logging.DEBUG, False), (logging.ERROR, True)]
    assert "second" in caplog.records[1].getMessage()
