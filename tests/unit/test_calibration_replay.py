"""``python -m bench.calibration_replay``: kv-aware's predictions replayed over a real
run's requests, through the strategy's own calibration."""

from __future__ import annotations

import json

import pytest

from bench import calibration_replay as replay

# The pods of the synthetic run: 20 ms + 500 us a computed token, + 2 ms a running request.
TRUE_OVERHEAD_MS, TRUE_MS_PER_TOKEN, TRUE_MS_PER_RUNNING = 20.0, 0.5, 2.0
# kv-aware is configured with a model twice as fast as the pods.
CONFIGURED = {"cost_model": {"prefill_overhead_s": 0.010, "prefill_tokens_per_s": 4000,
                             "decode_s_per_running": 0.001, "block_size": 32}}  # fmt: skip


def _row(cell, seed, index, sent_ms, computed, running, cached=256):
    ttft = TRUE_OVERHEAD_MS + computed * TRUE_MS_PER_TOKEN + running * TRUE_MS_PER_RUNNING
    return {"cell": cell, "router": "kv-aware", "seed": seed, "index": index, "ok": True,
            "pod": "pod-0", "sent_ms": sent_ms, "ttft_ms": ttft, "e2e_ms": ttft + 50,
            "predicted_ttft_ms": 1.0, "prompt_tokens": cached + computed,
            "cached_tokens": cached, "predicted_cached_tokens": cached}  # fmt: skip


def _write_run(tmp_path, rows, cells=(), kv_options=CONFIGURED):
    (tmp_path / "results.json").write_text(json.dumps({"kv_options": kv_options,
                                                       "cells": list(cells)}))  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path


def _one_at_a_time(cell="solo@closed:1", seed=0, n=64):
    """Requests sent each after the last one ended: nothing queued, nothing running."""
    rows, at = [], 0.0
    for i in range(n):
        rows.append(_row(cell, seed, i, at, computed=32 + (i * 97) % 900, running=0))
        at += rows[-1]["e2e_ms"] + 1
    return rows


def test_calibration_learns_the_pods_where_the_configured_model_is_off(tmp_path):
    run = _write_run(tmp_path, _one_at_a_time())
    settings = [replay.parse_setting(s) for s in ("off", "default")]
    off, default = replay.replay(run, settings)
    # Configured twice as fast as the pods: every prediction about half the TTFT.
    assert off.requests == 64
    assert off.median == pytest.approx(0.5, abs=0.01)
    assert off.signed_median == pytest.approx(-0.5, abs=0.01)
    # Calibrated, the fit is exact after min_samples: the error is the first few's.
    assert default.median < 0.01
    assert default.p90 < off.median


def test_requests_ahead_on_the_same_pod_are_queued_and_running(tmp_path):
    first = _row("pair@closed:2", 0, 0, 0.0, computed=400, running=0)
    # Sent while the first is prefilling: it waits behind 400 tokens, then runs beside it.
    second = _row("pair@closed:2", 0, 1, 1.0, computed=64, running=1)
    second["ttft_ms"] += first["ttft_ms"] - 1.0
    second["e2e_ms"] = second["ttft_ms"] + 50
    elsewhere = dict(second, pod="pod-1", index=2, sent_ms=2.0)
    kv = replay.KvAware(cost_model=CONFIGURED["cost_model"], calibrate=False)
    errors = replay.replay_cell([first, second, elsewhere], CONFIGURED, replay.parse_setting("off"))
    model = kv.cost_model(replay.MODEL)
    alone = model.prefill_s(64) + 256 * model.prefill_s_per_cached_token
    queued = (
        400 * model.prefill_s_per_token + model.prefill_overhead_s * model.queued_overhead_share
    )
    predicted_second = (queued + model.decode_s_per_running + alone) * 1000
    assert errors[1] == pytest.approx((predicted_second - second["ttft_ms"]) / second["ttft_ms"])
    # On another pod nothing is ahead of it.
    assert errors[2] == pytest.approx((alone * 1000 - second["ttft_ms"]) / second["ttft_ms"])


def test_observed_ttft_is_on_the_gateways_clock_unless_asked(tmp_path):
    rows = _one_at_a_time("solo@closed:1")
    # The client saw 10 ms more than the gateway's kvgate_ttft_seconds in this cell.
    cell = {"workload": "solo", "load": "closed:1", "router": "kv-aware", "seed": 0,
            "ttft_mean_ms": 110.0, "gateway_ttft_mean_ms": 100.0}  # fmt: skip
    for r in rows:
        r["ttft_ms"] += 10.0
    # kv-aware configured with the pods' own law, not calibrated.
    exact = {"cost_model": {"prefill_overhead_s": TRUE_OVERHEAD_MS / 1000,
                            "prefill_tokens_per_s": 1000 / TRUE_MS_PER_TOKEN,
                            "decode_s_per_running": TRUE_MS_PER_RUNNING / 1000}}  # fmt: skip
    run = _write_run(tmp_path, rows, [cell], exact)
    (gateway,) = replay.replay(run, [replay.parse_setting("off")])
    (client,) = replay.replay(run, [replay.parse_setting("off")], client_clock=True)
    assert gateway.median == pytest.approx(0.0, abs=1e-9)  # 10 ms taken off each
    assert gateway.p90 == pytest.approx(0.0, abs=1e-9)
    assert client.signed_median < -0.01  # the 10 ms are not what the model predicts


def test_learning_at_the_first_token_uses_what_is_known_before_the_streams_end(tmp_path):
    # Each request is sent after the last one's first token and before its end (long
    # streams): only learning at the first token sees any TTFT before the next send.
    rows, at = [], 0.0
    for i in range(64):
        row = _row("long@closed:1", 0, i, at, computed=32 + (i * 97) % 900, running=0)
        row["e2e_ms"] = 1e6  # every stream ends after the last send
        rows.append(row)
        at += row["ttft_ms"] + 1
    run = _write_run(tmp_path, rows)
    settings = [replay.parse_setting(s) for s in ("off", "learn-at-end", "default")]
    off, at_end, at_first_token = replay.replay(run, settings)
    assert off.median > 0.3  # configured twice as fast as the pods
    assert at_end.median == pytest.approx(off.median)  # learnt nothing in time
    assert at_first_token.median < 0.1


@pytest.mark.parametrize("text", ["windw=3", "window", "off,window=3", "window=x", "window=1"])
def test_a_setting_it_cannot_read_is_refused(text):
    with pytest.raises(ValueError):
        replay.parse_setting(text)


def test_the_command_prints_a_row_per_cell_and_setting(tmp_path, capsys):
    run = _write_run(tmp_path, _one_at_a_time("a@closed:1") + _one_at_a_time("b@closed:1"))
    assert replay.main([str(run), "--settings", "off", "window=16,refit_every=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 2 * 2
    assert lines[1].split()[:2] == ["a@closed:1", "off"]
    assert lines[4].split()[:2] == ["b@closed:1", "window=16,refit_every=1"]
