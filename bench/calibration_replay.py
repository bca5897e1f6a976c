"""kv-aware's TTFT predictions replayed over a ``kvgate bench real`` run.

    python -m bench.calibration_replay reports/real-s31a
    python -m bench.calibration_replay RUN --settings off default window=32,refit_every=1

Each kv-aware cell of the run (``requests.jsonl``) is replayed per seed, in the order
its requests were sent, through the real strategy (``routing.strategies.kv_aware``):
at each request's send the pod it went to is seen as the load generator saw it (the
requests sent there before it and not yet at their first token are prefilling, with
the uncached tokens kvgate predicted; those not yet finished are running), the
strategy's current cost model predicts its TTFT, and at its first token the strategy
observes the request with the cached tokens kvgate predicted (at its end, with the
engine's count, under ``learn-at-end``), which refits the model as in the gateway.
(The gateway revises a first-token point at the end where the engine counted other
cached tokens than kvgate predicted; the replay does not, and on the runs of
docs/real-engines.md the two counts never differed.)
Placement is the run's own: the replay asks what another calibration would have
predicted for the same requests, not where it would have sent them.

Observed TTFT is the client's, less the cell's *beyond* (the client's mean TTFT less
kvgate's ``kvgate_ttft_seconds`` mean: the request's way to the gateway and back), so
the error is on the gateway's clock, as ``kvgate_predicted_ttft_relative_error``.
``--client-clock`` leaves the client's TTFT as it is. What the replay cannot see: the
scraped queue gauges (kvgate's own counts are larger on these pods, which only it
feeds) and the exact moment the gateway saw each first byte.

Each setting is a ``Calibrator`` option set (``window``, ``min_samples``,
``refit_every``, ``max_change``, ``min_pair_tokens``) or ``off`` (the run's configured
cost model, not calibrated) or ``default`` (the shipped options) or ``one-speed`` (the
shipped options, every pod priced at the model's average speed: ``routing.pod_speed``
off) or ``learn-at-end`` (the shipped options, each request observed at its end:
``learn_at_first_token`` off). Prints, per cell and setting, the median, signed median
and p90 of |predicted - observed| / observed over all seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.real_fleet import RealCell
from bench.stats import percentile
from routing.calibration import Calibrator
from routing.cost_model import running_requests
from routing.strategies.kv_aware import KvAware
from routing.types import Decision, Outcome, PodView, RouteRequest

MODEL = "replay"  # one calibrator: a run serves one model
DEFAULT_SETTINGS = ("off", "default", "one-speed", "learn-at-end", "window=32", "refit_every=1")
_OPTIONS = ("window", "min_samples", "refit_every", "max_change", "min_pair_tokens")


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    calibrate: bool
    options: dict[str, int | float]
    pod_speeds: bool = True
    at_first_token: bool = True


@dataclass(frozen=True, slots=True)
class ReplayError:
    """One cell and setting: relative errors over every seed's requests."""

    cell: str
    setting: str
    requests: int
    median: float
    signed_median: float
    p90: float


def parse_setting(text: str) -> Setting:
    """``off``, ``default`` or ``key=value[,key=value]`` of ``Calibrator`` options."""
    if text == "off":
        return Setting(text, False, {})
    if text == "default":
        return Setting(text, True, {})
    if text == "one-speed":
        return Setting(text, True, {}, pod_speeds=False)
    if text == "learn-at-end":
        return Setting(text, True, {}, at_first_token=False)
    options: dict[str, int | float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in _OPTIONS:
            raise ValueError(f"calibration setting {part!r}: expected off, default, one-speed, "
                             f"learn-at-end or {'|'.join(_OPTIONS)}=N")  # fmt: skip
        options[key] = float(value) if key == "max_change" else int(value)
    Calibrator(**options)  # out-of-range options fail here, with the Calibrator's message
    return Setting(text, True, options)


def replay_cell(
    rows: Sequence[dict[str, Any]],
    kv_options: dict[str, Any],
    setting: Setting,
    offset_ms: float = 0.0,
) -> list[float]:
    """Signed relative errors, (predicted - observed) / observed, of one seed's
    requests of one cell, in send order. ``offset_ms`` is taken off each observed
    TTFT (at least 1 ms is left)."""
    strategy = KvAware(
        cost_model=kv_options.get("cost_model"),
        calibrate=setting.calibrate,
        calibration=setting.options or None,
        pod_speeds=setting.pod_speeds,
        learn_at_first_token=setting.at_first_token,
    )
    rows = sorted((r for r in rows if r.get("ok")), key=lambda r: r["sent_ms"])
    observed = {id(r): max(1.0, r["ttft_ms"] - offset_ms) for r in rows}
    # Events in time order: a request's observation (0: its first token, or its end)
    # before a send (1) at the same ms.
    learnt_ms = "ttft_ms" if strategy.learns_at_first_token else "e2e_ms"
    events = [(r["sent_ms"], 1, i) for i, r in enumerate(rows)]
    events += [(r["sent_ms"] + r[learnt_ms], 0, i) for i, r in enumerate(rows)]
    events.sort()
    decisions: dict[int, Decision] = {}
    errors: list[float] = []
    for at, kind, i in events:
        row = rows[i]
        request = RouteRequest(model=MODEL, prompt_tokens=row["prompt_tokens"])
        if kind == 0:
            ttft_s = observed[id(row)] / 1000
            if strategy.learns_at_first_token:  # the counts kvgate predicted
                outcome = Outcome(ok=True, ttft_s=ttft_s)
            else:
                outcome = Outcome(ok=True, ttft_s=ttft_s, prompt_tokens=row["prompt_tokens"],
                                  cached_tokens=row["cached_tokens"])  # fmt: skip
            strategy.observe(request, decisions.pop(i), outcome)
            continue
        pod = _pod_at(row["pod"], at, rows[:i])
        cost = strategy.pod_cost_model(MODEL, pod.id)
        l0 = row["predicted_cached_tokens"]
        predicted = cost.predict_ttft_s(pod, l0, 0, 0, row["prompt_tokens"])
        decisions[i] = Decision(
            pod=pod.id,
            strategy=strategy.name,
            reason="replay",
            predicted_l0_tokens=l0,
            predicted_ttft_s=predicted,
            predicted_queue_s=cost.queue_delay_s(pod),
            predicted_running=running_requests(pod),
        )
        errors.append((predicted * 1000 - observed[id(row)]) / observed[id(row)])
    return errors


def _pod_at(pod: str, at_ms: float, earlier: Iterable[dict[str, Any]]) -> PodView:
    """``pod`` as this gateway's counts saw it at ``at_ms``, from the requests sent
    before: running until their end, prefilling until their first token."""
    in_flight = prefilling = prefill_tokens = 0
    for r in earlier:
        if r["pod"] != pod or r["sent_ms"] + r["e2e_ms"] <= at_ms:
            continue
        in_flight += 1
        if r["sent_ms"] + r["ttft_ms"] > at_ms:
            prefilling += 1
            prefill_tokens += r["prompt_tokens"] - r["predicted_cached_tokens"]
    return PodView(pod, in_flight=in_flight, in_flight_prefill_tokens=prefill_tokens,
                   prefilling=prefilling)  # fmt: skip


def replay(
    run: Path, settings: Sequence[Setting], router: str = "kv-aware", client_clock: bool = False
) -> list[ReplayError]:
    """Every cell of ``router`` in ``run``, under each setting."""
    results = json.loads((run / "results.json").read_text())
    kv_options = results.get("kv_options") or {}
    offsets = {} if client_clock else _beyond_gateway_ms(results["cells"], router)
    rows = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["router"] == router and r.get("predicted_ttft_ms") is not None]
    out = []
    for cell in dict.fromkeys(r["cell"] for r in rows):
        for setting in settings:
            errors: list[float] = []
            for seed in sorted({r["seed"] for r in rows if r["cell"] == cell}):
                seed_rows = [r for r in rows if r["cell"] == cell and r["seed"] == seed]
                offset = offsets.get((cell, seed), 0.0)
                errors += replay_cell(seed_rows, kv_options, setting, offset)
            if errors:
                absolute = [abs(e) for e in errors]
                out.append(ReplayError(cell, setting.name, len(errors),
                                       statistics.median(absolute), statistics.median(errors),
                                       percentile(absolute, 90)))  # fmt: skip
    return out


def _beyond_gateway_ms(cells: list[dict[str, Any]], router: str) -> dict[tuple[str, int], float]:
    """Per (cell, seed): the client's mean TTFT less kvgate's own
    (``RealCell.beyond_gateway_ms``), where both are known."""
    out = {}
    for cell in (RealCell(**c) for c in cells):
        beyond = cell.beyond_gateway_ms
        if cell.router == router and beyond is not None:
            out[(f"{cell.workload}@{cell.load}", cell.seed)] = max(0.0, beyond)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a `kvgate bench real --out` folder")
    p.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS),
                   help="off, default, one-speed, learn-at-end or key=value[,key=value] "
                        "Calibrator options")  # fmt: skip
    p.add_argument("--router", default="kv-aware")
    clock = "errors on the load generator's clock (the report's first column)"
    p.add_argument("--client-clock", action="store_true", help=clock)
    args = p.parse_args(argv)
    try:
        settings = [parse_setting(s) for s in args.settings]
    except ValueError as exc:
        p.error(str(exc))
    results = replay(args.run, settings, args.router, args.client_clock)
    print(f"{'cell':30s} {'setting':28s} {'requests':>8s} {'median':>7s} {'signed':>7s} "
          f"{'p90':>6s}")  # fmt: skip
    for r in results:
        print(f"{r.cell:30s} {r.setting:28s} {r.requests:8d} {r.median:7.1%} "
              f"{r.signed_median:+7.1%} {r.p90:6.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
