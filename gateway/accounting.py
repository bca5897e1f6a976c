"""What a finished request leaves behind: metrics, and the outcome the strategy learns from.

``Attempt`` is one dispatch of one request to one pod; ``Accounting.record`` closes it
exactly once, whichever way it ended (answered, failed, timed out, abandoned by the
client), and hands the routing core the outcome that releases the pod's load.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import msgspec

from gateway.metrics import GatewayMetrics
from gateway.pods import Pod
from gateway.router import Router
from routing.core import Routed
from routing.types import Outcome

USAGE_TAIL_BYTES = 16 * 1024  # vLLM's usage chunk is the last event of a stream
_USAGE_KEY = re.compile(r'"usage"\s*:\s*\{')
_json_decoder = json.JSONDecoder()
_USAGE_KEYS_TRIED = 8  # the last few "usage" keys of a stream's tail are parsed, not all
# No context is this long; a usage count beyond it is a pod's garbage.
MAX_USAGE_TOKENS = 1 << 31


@dataclass(slots=True)
class Attempt:
    """Everything the finishing code needs about one dispatched request."""

    pod: Pod
    routed: Routed  # the routing core's record: decision, strategy, held load
    arrived: float  # perf_counter at arrival
    model: str
    ttft_s: float | None = None
    recorded: bool = False
    lost: bool = False  # its pod was ejected for failing probes before it answered

    @property
    def strategy(self) -> str:
        return self.routed.strategy.name


class Accounting:
    def __init__(self, metrics: GatewayMetrics, router: Router) -> None:
        self._metrics = metrics
        self._router = router

    def record(self, a: Attempt, status: int, usage: dict[str, object] | None) -> None:
        """Metrics of the finished request; releases its load and lets the strategy learn.

        Only the first call per attempt counts."""
        if a.recorded:
            return
        a.recorded = True
        m = self._metrics
        m.requests.labels(a.model, a.pod.name, a.strategy, str(status)).inc()
        m.latency.labels(a.model, a.pod.name, a.strategy).observe(time.perf_counter() - a.arrived)
        if a.ttft_s is not None:
            m.ttft.labels(a.model, a.pod.name, a.strategy).observe(a.ttft_s)
        d = a.routed.decision
        if d.predicted_ttft_s is not None:
            for tier, n in (("L0", d.predicted_l0_tokens), ("L1", d.predicted_l1_tokens),
                            ("L2", d.predicted_l2_tokens)):  # fmt: skip
                m.predicted_tokens.labels(a.strategy, tier).inc(n)
        prompt_tokens, cached = token_counts(usage)
        if prompt_tokens is not None:
            cached_n = cached or 0
            m.prompt_tokens.labels(a.model, a.pod.name, "cached").inc(cached_n)
            m.prompt_tokens.labels(a.model, a.pod.name, "computed").inc(prompt_tokens - cached_n)
            if d.predicted_ttft_s is not None and cached is not None:
                m.cached_tokens_error.labels(a.strategy).observe(
                    abs(d.predicted_cached_tokens - cached)
                )
                if a.ttft_s is not None:
                    m.ttft_error.labels(a.strategy).observe(abs(d.predicted_ttft_s - a.ttft_s))
        if d.predicted_ttft_s is not None and a.ttft_s:
            error = abs(d.predicted_ttft_s - a.ttft_s) / a.ttft_s
            m.ttft_relative_error.labels(a.strategy).observe(error)
        outcome = Outcome(
            ok=status < 400, ttft_s=a.ttft_s, prompt_tokens=prompt_tokens, cached_tokens=cached
        )
        self._router.finish(a.routed, outcome)


def usage_from_json(body: bytes) -> dict[str, object] | None:
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


def usage_from_sse(tail: bytes) -> dict[str, object] | None:
    """The last usage object in a stream's tail (vLLM puts it last: a chat chunk of its
    own, Anthropic's ``message_delta``, the Responses API's ``response.completed``).

    Read from its key onwards, so an event whose start fell off the tail (a long
    ``response.completed`` repeats the whole output before its usage) still counts.
    A ``"usage": {`` with unescaped quotes only occurs as a key: in generated text the
    quotes are escaped."""
    text = tail.decode("utf-8", "replace")
    # The usage is the last such key; a tail of thousands of them (a pod's garbage) would
    # cost a parse attempt each, on the event loop, at every stream's end.
    for found in reversed(list(_USAGE_KEY.finditer(text))[-_USAGE_KEYS_TRIED:]):
        try:
            usage, _ = _json_decoder.raw_decode(text, found.end() - 1)
        except (ValueError, RecursionError):
            continue
        if isinstance(usage, dict):
            return usage
    return None


def token_counts(usage: dict[str, object] | None) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` of a usage object, None where absent.

    OpenAI's chat/completions usage has ``prompt_tokens`` and
    ``prompt_tokens_details.cached_tokens``; the Responses API's ``input_tokens`` and
    ``input_tokens_details.cached_tokens``; Anthropic's counts cache reads and writes
    apart from ``input_tokens`` (vLLM: input = prompt - read - created)."""
    if not usage:
        return None, None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if prompt is None and _is_int(usage.get("input_tokens")):
        prompt = usage["input_tokens"]
        details = usage.get("input_tokens_details")
        if isinstance(details, dict):  # Responses
            cached = details.get("cached_tokens")
        else:  # Anthropic
            cached = usage.get("cache_read_input_tokens")
            created = usage.get("cache_creation_input_tokens")
            prompt += (cached if _is_int(cached) else 0) + (created if _is_int(created) else 0)
    if not (_is_int(prompt) and 0 <= prompt < MAX_USAGE_TOKENS):  # type: ignore[operator]
        return None, None
    # A cached count the prompt cannot hold is a pod's garbage: it would count negative
    # computed tokens (which the metric refuses, losing the response) and mislead the
    # strategy's learning.
    cached_ok = _is_int(cached) and 0 <= cached <= prompt  # type: ignore[operator]
    return prompt, cached if cached_ok else None  # type: ignore[return-value]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
