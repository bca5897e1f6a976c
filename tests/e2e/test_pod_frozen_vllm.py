"""A real vLLM pod that freezes mid-generation (SIGSTOP of its whole process group: a
hung server whose connections stay open and silent). Its probes fail, the gateway
ejects it, and the non-streamed request it was generating, of which the client has
seen nothing, is served by the other pod at once (``gateway.awaiting``); before, it
waited for ``timeouts.total_s`` (900 s by default) and ended in a 504. A stream it was
feeding ends with an SSE error event; before, it waited ``stream_idle_s`` (60 s).

The pods are the session's; the frozen one is thawed before the test ends, and the
request it held is aborted when the gateway closes its connection."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai

from bench.gateway_proc import run_gateway
from bench.polling import scraped, wait_for
from bench.vllm_pods import MODEL_NAME, VllmServer

NAMES = ("pod-a", "pod-b")
TOTAL_S = 60  # the deadline the request would wait for without the retry


def _in_flight(gw: str, pod: str) -> float:
    return sum(scraped(gw, "kvgate_pod_in_flight_requests", pod=pod))


def _healthy(gw: str, pod: str) -> bool:
    return scraped(gw, "kvgate_pod_healthy", pod=pod) == [1.0]


def test_a_frozen_vllm_pods_request_is_answered_by_the_other_pod(
    vllm_pods: list[VllmServer], tiny_tokenizer_dir: Path, nonce: str
) -> None:
    env = {
        "KVGATE_MODELS": json.dumps({MODEL_NAME: {"tokenizer": str(tiny_tokenizer_dir)}}),
        "KVGATE_HEALTH__INTERVAL_S": "0.5",
        "KVGATE_HEALTH__PROBE_TIMEOUT_S": "1.0",
        "KVGATE_TIMEOUTS__FIRST_BYTE_S": str(TOTAL_S),
        "KVGATE_TIMEOUTS__TOTAL_S": str(TOTAL_S),
    }
    pods = list(zip(NAMES, vllm_pods, strict=True))
    with run_gateway([(n, p.url) for n, p in pods], "round-robin", env=env) as gw:
        wait_for(lambda: all(_healthy(gw, n) for n in NAMES), 30, what="both pods in rotation")
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0, timeout=120)
        result: dict[str, object] = {}

        def ask() -> None:
            try:
                raw = client.completions.with_raw_response.create(
                    model=MODEL_NAME,
                    prompt=f"{nonce} a story that goes on",
                    max_tokens=3000,  # seconds of decoding on a CPU pod (over 3 s at the fastest)
                    extra_body={"ignore_eos": True},
                )
                result["pod"] = raw.headers["x-kvgate-pod"]
                result["tokens"] = raw.parse().usage.completion_tokens  # type: ignore[union-attr]
            except openai.APIStatusError as exc:
                result["status"] = exc.status_code
            except openai.APIError as exc:  # the assertions below show it
                result["error"] = repr(exc)
            result["done"] = time.monotonic()

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(lambda: "done" in result or any(_in_flight(gw, n) for n in NAMES), 30,
                 poll=0.02, what="the request at a pod")  # fmt: skip
        at = [(n, p) for n, p in pods if _in_flight(gw, n)]
        assert at, f"the request ended before its pod could be frozen: {result}"
        frozen_name, frozen = at[0]
        other = next(n for n in NAMES if n != frozen_name)
        frozen.freeze()
        stopped = time.monotonic()
        try:
            asker.join(timeout=TOTAL_S)
        finally:
            frozen.thaw()
        wait_for(lambda: _healthy(gw, frozen_name), 60, what="the thawed pod back in rotation")

    assert not asker.is_alive()
    assert result.get("pod") == other, result
    assert result.get("tokens") == 3000
    # ejected after two failed probes, then the whole answer again from the other pod,
    # long before the deadline the request used to wait for
    assert float(result["done"]) - stopped < TOTAL_S / 2  # type: ignore[arg-type]


def test_a_frozen_vllm_pods_stream_ends_once_the_pod_is_ejected(
    vllm_pods: list[VllmServer], tiny_tokenizer_dir: Path, nonce: str
) -> None:
    """A stream whose client has its first tokens cannot change pods. Its pod frozen,
    it waited ``stream_idle_s`` (60 s by default) for the next chunk; ejected for
    failing its probes, the pod's quiet stream ends at once with an SSE error event."""
    env = {
        "KVGATE_MODELS": json.dumps({MODEL_NAME: {"tokenizer": str(tiny_tokenizer_dir)}}),
        "KVGATE_HEALTH__INTERVAL_S": "0.5",
        "KVGATE_HEALTH__PROBE_TIMEOUT_S": "1.0",
        "KVGATE_TIMEOUTS__STREAM_IDLE_S": str(TOTAL_S),
    }
    pods = dict(zip(NAMES, vllm_pods, strict=True))
    with run_gateway([(n, p.url) for n, p in pods.items()], "round-robin", env=env) as gw:
        wait_for(lambda: all(_healthy(gw, n) for n in NAMES), 30, what="both pods in rotation")
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME,
            prompt=f"{nonce} a story that goes on",
            max_tokens=3000,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        frozen_name = raw.headers["x-kvgate-pod"]
        chunks = iter(raw.parse())
        for _ in range(5):
            next(chunks)  # the client has its first tokens
        pods[frozen_name].freeze()
        stopped = time.monotonic()
        try:
            error = ""
            try:
                for _ in chunks:
                    pass
            except openai.APIError as exc:
                error = str(exc)
            ended_s = time.monotonic() - stopped
        finally:
            pods[frozen_name].thaw()
        wait_for(lambda: _healthy(gw, frozen_name), 60, what="the thawed pod back in rotation")

    print(f"\nthe stream ended {ended_s:.2f} s after the stop")  # docs/deploy.md's number
    assert "stopped answering its probes" in error, error
    # ejected after two failed probes (0.5 s apart, 1 s each), then at once: quiet since
    assert ended_s < TOTAL_S / 4, ended_s
