"""The gateway's log level, at start and on a reload.

httpx logs every request it sends at INFO ("HTTP Request: GET .../metrics ..."): the
gateway's own health probes, model listings and engine scrapes, three requests a
pod every ``health.interval_s`` in every worker, would be most of an INFO log (with
50 pods and two workers ~150 lines a second) and say nothing a failed probe does not
say at WARNING. Below DEBUG they are left out.
"""

from __future__ import annotations

import logging
import time

# Loggers that write a line per HTTP request the gateway makes.
PER_REQUEST_LOGGERS = ("httpx",)


def set_log_level(level: str) -> None:
    """The root logger at ``level``; the per-request loggers at WARNING unless DEBUG."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    quiet = logging.NOTSET if root.getEffectiveLevel() <= logging.DEBUG else logging.WARNING
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


class ThrottledError:
    """Logs a background task's unexpected failure with its traceback at most once per
    ``every_s``, and at DEBUG in between: a loop that fails every round (every few
    milliseconds for the load exchange) must not flood the log."""

    def __init__(self, logger: logging.Logger, message: str, every_s: float = 60.0) -> None:
        self._log = logger
        self._message = message
        self._every_s = every_s
        self._last_at = float("-inf")

    def __call__(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_at >= self._every_s:
            self._last_at = now
            self._log.error(self._message, exc_info=exc)
        else:
            self._log.debug("%s: %r", self._message, exc)
