"""Settings that would quietly open a door or break a part later are refused when read:
empty API keys, data-parallel ranks no pod has, a span queue shorter than one export."""

from __future__ import annotations

import pydantic
import pytest

from gateway.auth import key_matches
from gateway.config import MAX_DP_RANKS, PodConfig, Settings, TracingSettings


@pytest.mark.parametrize("keys", [[""], [" "], ["good", ""], [" padded"]])
def test_an_empty_or_padded_key_is_refused_wherever_keys_are_set(keys):
    with pytest.raises(pydantic.ValidationError, match="non-empty"):
        Settings(api_keys=keys)
    with pytest.raises(pydantic.ValidationError, match="non-empty"):
        Settings(admin={"host": "0.0.0.0", "api_keys": keys})
    with pytest.raises(pydantic.ValidationError, match="non-empty"):
        Settings(admission={"tenants": [{"name": "t", "api_keys": keys}]})


def test_an_empty_events_key_is_refused():
    with pytest.raises(pydantic.ValidationError, match="non-empty"):
        PodConfig(name="p", url="http://p", events_key="")


def test_an_empty_presented_key_never_matches_not_even_an_empty_one():
    assert not key_matches("", [""])
    assert not key_matches(None, ["k"])
    assert key_matches("k", ["k"])


@pytest.mark.parametrize("ranks", [0, -1, MAX_DP_RANKS + 1, 1_000_000_000])
def test_data_parallel_ranks_are_between_one_and_the_cap(ranks):
    with pytest.raises(pydantic.ValidationError):
        PodConfig(name="p", url="http://p", dp_ranks=ranks)


def test_ranks_whose_ports_pass_65535_are_refused():
    PodConfig(name="p", url="http://p", kv_events="tcp://10.0.0.1:65534", dp_ranks=2)
    with pytest.raises(pydantic.ValidationError, match="65535"):
        PodConfig(name="p", url="http://p", kv_events="tcp://10.0.0.1:65534", dp_ranks=3)


def test_a_span_queue_shorter_than_one_export_batch_is_refused_by_name():
    with pytest.raises(pydantic.ValidationError, match="max_queued_spans"):
        TracingSettings(max_queued_spans=100)
