"""``bench.polling``: the one wait loop the benchmarks and tests share."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from bench.polling import metric_samples, metric_value, scraped, wait_for, wait_for_async


def test_wait_for_returns_the_first_truthy_value_the_predicate_gives():
    answers = iter([None, 0, "", {"pod": "a"}, {"pod": "b"}])

    assert wait_for(lambda: next(answers), timeout=5, poll=0) == {"pod": "a"}


def test_wait_for_names_what_it_waited_for_when_time_runs_out():
    calls = itertools.count()

    with pytest.raises(TimeoutError, match=r"^timed out after 0.05s waiting for the pod$"):
        wait_for(lambda: next(calls) < 0, timeout=0.05, what="the pod", poll=0.01)
    assert next(calls) >= 2  # it polled more than once before giving up


def test_an_error_in_the_predicate_fails_at_once_instead_of_waiting_out_the_timeout():
    calls = itertools.count()

    def exited() -> bool:
        next(calls)
        raise RuntimeError("process exited with 1")

    with pytest.raises(RuntimeError, match="process exited with 1"):
        wait_for(exited, timeout=3600)
    assert next(calls) == 1


async def test_wait_for_async_lets_other_tasks_run_between_polls():
    flag: list[bool] = []
    asyncio.get_running_loop().call_later(0.02, flag.append, True)

    assert await wait_for_async(lambda: flag, timeout=5, poll=0.005) == [True]


def test_metric_value_sums_every_label_set_of_one_metric_only():
    text = (
        "# TYPE kvgate_requests_total counter\n"
        'kvgate_requests_total{pod="a"} 3.0\n'
        'kvgate_requests_total{pod="b"} 4.0\n'
        "kvgate_requests_total_created 1.7e9\n"
        "kvgate_up 1.0\n"
    )

    assert metric_value(text, "kvgate_requests_total") == 7.0
    assert metric_value(text, "kvgate_up") == 1.0


def test_metric_value_keeps_the_label_sets_that_include_the_labels_asked_for():
    text = (
        'kvgate_pod_in_flight_requests{pod="a"} 2.0\n'
        'kvgate_pod_in_flight_requests{pod="ab"} 5.0\n'
        'kvgate_retries_total{cause="pod_lost",model="m"} 1.0\n'
        'kvgate_retries_total{cause="connect",model="m"} 4.0\n'
        "kvgate_up 1.0\n"
    )

    assert metric_value(text, "kvgate_pod_in_flight_requests", pod="a") == 2.0  # not "ab"
    assert metric_value(text, "kvgate_pod_in_flight_requests", pod="c") == 0.0
    assert metric_value(text, "kvgate_retries_total", model="m") == 5.0
    assert metric_value(text, "kvgate_retries_total", model="m", cause="pod_lost") == 1.0
    assert metric_value(text, "kvgate_up", pod="a") == 0.0  # no labels to match


def test_metric_samples_tells_an_absent_series_from_a_zero_one():
    text = 'kvgate_pod_healthy{pod="a"} 0.0\nkvgate_pod_healthy{pod="b"} 1.0\n'

    assert metric_samples(text, "kvgate_pod_healthy", pod="a") == [0.0]
    assert metric_samples(text, "kvgate_pod_healthy", pod="c") == []  # metric_value: 0
    assert metric_samples(text, "kvgate_pod_healthy") == [0.0, 1.0]


def test_scraped_reads_the_samples_a_live_server_exposes():
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    from bench.ports import free_port

    registry = CollectorRegistry()
    Gauge("kvgate_pod_healthy", "h", ["pod"], registry=registry).labels(pod="a").set(1)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        assert scraped(f"http://127.0.0.1:{port}", "kvgate_pod_healthy", pod="a") == [1.0]
    finally:
        server.shutdown()
        thread.join()
