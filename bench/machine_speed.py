"""How fast this machine's CPU runs right now, sampled beside a benchmark.

On the 2-vCPU VM these benchmarks run on, this module's loop takes about 0.85 or about
1.4 ms of CPU time, flipping between the two every few seconds, on an idle machine, with
no steal time (docs/real-engines.md, "What each router's CPU costs, and the machine's
two speeds"). A router's
cell on real pods lasts ~12 s, so the speed the machine ran at during a cell moves its
TTFT as much as the router does. ``SpeedSampler`` times a fixed loop (~1 ms of CPU) every
``period_s`` in a process of its own (~0.4% of a core) and keeps the samples; a benchmark
asks for the median over each cell's window (``median_ms``) and reports it beside the
cell, so a comparison made across the machine's speeds can be seen as one.

The loop's *CPU* time is measured, not its wall time: waiting for a core the pods hold
is load, not speed.

    python -m bench.machine_speed --seconds 60   # the samples now, and their spread
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from types import TracebackType

from bench.processes import stop

LOOP_ITERATIONS = 20_000  # ~1 ms of CPU on this machine's fast speed
DEFAULT_PERIOD_S = 0.25
MAX_SAMPLES = 100_000  # ~7 hours at the default period


def loop_cpu_ms(iterations: int = LOOP_ITERATIONS) -> float:
    """CPU milliseconds of a fixed pure-Python loop (integer arithmetic: no memory traffic
    beyond the interpreter's own)."""
    started = time.thread_time()
    total = 0
    for i in range(iterations):
        total += i * i
    return (time.thread_time() - started) * 1000


class SpeedSampler:
    """Samples ``loop_cpu_ms`` every ``period_s`` in a child process, as (monotonic time,
    ms) pairs; ``time.monotonic`` is one clock for every process on Linux."""

    def __init__(self, period_s: float = DEFAULT_PERIOD_S) -> None:
        self.period_s = period_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> SpeedSampler:
        cmd = [sys.executable, "-m", "bench.machine_speed", "--emit"]
        cmd += ["--period", str(self.period_s)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                at, ms = map(float, line.split())
            except ValueError:
                continue
            with self._lock:
                self._samples.append((at, ms))

    def stop(self) -> None:
        if self._proc is not None:
            stop(self._proc)
        if self._reader is not None:
            self._reader.join(10)

    def samples(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        with self._lock:
            return [ms for at, ms in self._samples if start <= at <= end]

    def median_ms(self, start: float, end: float) -> float | None:
        """The loop's median CPU ms over ``[start, end]`` (monotonic); None without samples."""
        window = self.samples(start, end)
        return statistics.median(window) if window else None

    def __enter__(self) -> SpeedSampler:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _emit(period_s: float) -> None:
    """The child: one "monotonic-time ms" line per sample until terminated."""
    while True:
        ms = loop_cpu_ms()
        print(f"{time.monotonic():.4f} {ms:.4f}", flush=True)
        time.sleep(period_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="how long to sample")
    p.add_argument("--period", type=float, default=DEFAULT_PERIOD_S, help="seconds between")
    p.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)  # SpeedSampler's child
    args = p.parse_args(argv)
    if args.emit:
        try:
            _emit(args.period)
        except (KeyboardInterrupt, BrokenPipeError):
            pass
        return 0
    samples = []
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        samples.append(loop_cpu_ms())
        time.sleep(args.period)
    q = statistics.quantiles(samples, n=10)
    print(f"{len(samples)} samples of a {LOOP_ITERATIONS:,}-iteration loop, CPU ms: "
          f"p10 {q[0]:.2f}, median {statistics.median(samples):.2f}, p90 {q[-1]:.2f}, "
          f"max {max(samples):.2f}")  # fmt: skip
    print(" ".join(f"{ms:.2f}" for ms in samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
