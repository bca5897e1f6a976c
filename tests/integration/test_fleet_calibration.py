"""kv-aware's calibration pooled over replicas through Redis: after a round each
replica fits from every replica's points; a point that is not one is skipped. Run on a
single server and on a Redis Cluster (``redis_target``)."""

from __future__ import annotations

import uuid

import pytest

from gateway.fleet_calibration import CalibrationExchange, decode_point, encode_point
from routing.calibration import Calibrator
from routing.cost_model import CostModel
from tests.conftest import RedisTarget

pytestmark = pytest.mark.redis
MODEL = "org/model"


def _observe(cal: Calibrator, n: int, s_per_token: float, first: int = 100) -> None:
    """``n`` requests of growing length from a pod prefilling at ``s_per_token``."""
    for i in range(n):
        prompt = first + 97 * i
        cal.update(0.02 + prompt * s_per_token, prompt, 0)


def test_points_round_trip_and_what_no_request_can_give_is_skipped():
    assert decode_point(encode_point((512, 3, 0.125))) == (512, 3, 0.125)
    assert decode_point(b"512,3,-0.01") == (512, 3, -0.01)
    for bad in ("", "1,2", "0,0,0.1", "5,-1,0.1", "5,0,nan", "5,0,inf", "5,0,1e9",
                "x,0,0.1", "10000001,0,0.1", b"\xff,1,1"):  # fmt: skip
        assert decode_point(bad) is None, bad


async def test_every_replica_fits_from_every_replicas_points(redis_target: RedisTarget):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a_cal, b_cal = Calibrator(CostModel(), window=64), Calibrator(CostModel(), window=64)
    a = CalibrationExchange(redis_target.store(ns), lambda: [(MODEL, a_cal)])
    b = CalibrationExchange(redis_target.store(ns), lambda: [(MODEL, b_cal)])
    try:
        _observe(a_cal, 6, 0.001)  # a pod prefilling at 1,000 tokens/s
        _observe(b_cal, 6, 0.001, first=150)
        assert a_cal.current().prefill_tokens_per_s == CostModel().prefill_tokens_per_s
        await a.exchange()  # a's points in
        await b.exchange()  # b's in, then b fits from all twelve
        await a.exchange()  # a reads b's
        for cal in (a_cal, b_cal):
            assert len(cal._points) == 12
            assert cal.current().prefill_tokens_per_s == pytest.approx(1000, rel=0.01)
        assert sorted(a_cal._points) == sorted(b_cal._points)
        # The list is trimmed to the window, and a's next points arrive once only.
        _observe(a_cal, 60, 0.001)
        await a.exchange()
        await b.exchange()
        assert len(a_cal._points) == len(b_cal._points) == 64
        assert await a.redis.on_namespace(lambda r: r.llen(a.prefix + MODEL)) == 64
    finally:
        await a.redis.close()
        await b.redis.close()


async def test_a_hostile_point_is_skipped_and_the_rest_still_count(redis_target: RedisTarget):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    cal = Calibrator(CostModel(), window=64)
    ex = CalibrationExchange(redis_target.store(ns), lambda: [(MODEL, cal)])
    try:
        good = [encode_point((100 + 97 * i, 0, 0.02 + (100 + 97 * i) * 0.001)) for i in range(10)]
        key = ex.prefix + MODEL
        await ex.redis.on_namespace(lambda r: r.rpush(key, "junk", "5,0,1e300", *good))
        await ex.exchange()
        assert len(cal._points) == 10
        assert cal.current().prefill_tokens_per_s == pytest.approx(1000, rel=0.01)
    finally:
        await ex.redis.close()
