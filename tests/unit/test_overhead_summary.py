"""``kvgate bench overhead --runs N``: medians and worsts, worker ratios within a run, and
targets met per run, computed from the per-run results."""

from __future__ import annotations

from bench.overhead import RouterResult
from bench.overhead_summary import judge, markdown, median_and_worst, scaling


def _r(router: str, workload: str, run: int, **values: float) -> RouterResult:
    return RouterResult(router, workload, run=run, **values)  # type: ignore[arg-type]


def test_median_and_worst_take_the_worst_side_and_skip_missing_values():
    assert median_and_worst([0.5, 0.9, 0.6], lower_is_better=True) == (0.6, 0.9)
    assert median_and_worst([3000.0, 2500.0, float("nan"), 3500.0], False) == (3000.0, 2500.0)
    m, w = median_and_worst([float("nan")], True)
    assert m != m and w != w


def test_worker_ratio_pairs_each_run_with_its_own_one_worker_run():
    results = [
        _r("kvgate:kv-aware", "varied", 0, rps=1000.0),
        _r("kvgate:kv-aware@2", "varied", 0, rps=1700.0),
        _r("kvgate:kv-aware", "varied", 1, rps=1200.0),  # a faster moment of the machine
        _r("kvgate:kv-aware@2", "varied", 1, rps=1800.0),
    ]
    ((router, workload, ratios),) = scaling(results)
    assert (router, workload) == ("kvgate:kv-aware@2", "varied")
    assert ratios == [1.7, 1.5]


def test_targets_report_median_worst_and_runs_met():
    results = []
    for run, (stream_rr, stream_kv, p50) in enumerate([(0.3, 0.8, 0.6), (0.3, 1.2, 0.7),
                                                       (0.4, 0.9, 1.1)]):  # fmt: skip
        results += [
            _r("kvgate:round-robin", "varied", run, stream_ttft_added_ms=stream_rr),
            _r(
                "kvgate:kv-aware",
                "multi-turn",
                run,
                stream_ttft_added_ms=stream_kv,
                added_p50_ms=p50,
            ),  # fmt: skip
            _r("kvgate:kv-aware@2", "multi-turn", run, stream_ttft_added_ms=9.0),  # not judged
        ]
    outcomes = {o.target.name: o for o in judge(results, runs=3)}
    stream = outcomes["streaming TTFT added <= 1 ms, every strategy (its worst)"]
    assert stream.values == [0.8, 1.2, 0.9] and stream.worst == 1.2 and stream.runs_met == 2
    p50 = outcomes["kv-aware, multi-turn: added p50 <= 1 ms"]
    assert p50.median == 0.7 and p50.worst == 1.1 and p50.runs_met == 2
    assert "round-robin: >= 3,000 req/s" not in outcomes  # not measured: not judged
    text = "\n".join(markdown(results, 3))
    assert "| kv-aware, multi-turn: added p50 <= 1 ms | 0.70 | 1.10 | 2 of 3 | - / - |" in text


def test_a_targets_runs_are_told_apart_by_the_machines_speed_in_them():
    results = []
    for run, (rps, machine) in enumerate([(1600.0, 0.9), (1400.0, 1.4), (1550.0, 1.0)]):
        results += [
            _r("kvgate:kv-aware", "multi-turn", run, rps=rps, machine_ms=machine),
            _r("kvgate:kv-aware", "varied", run, machine_ms=machine + 0.1),  # the run's other row
        ]
    (outcome,) = [o for o in judge(results, runs=3) if "1,500 req/s" in o.target.name]
    assert outcome.machine_ms == [0.95, 1.45, 1.05]  # each run's median over its rows
    assert (outcome.machine_when(True), outcome.machine_when(False)) == (1.0, 1.45)
    text = "\n".join(markdown(results, 3))
    assert (
        "| kv-aware, multi-turn: >= 1,500 req/s | 1,550.00 | 1,400.00 | 2 of 3 | 1.00 / 1.45 |"
        in text
    )
    assert "| kvgate:kv-aware | multi-turn |" in text and "| 1.00 (1.40) |" in text  # its column
