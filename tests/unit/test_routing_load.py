"""LoadTracker: load counted at dispatch, released exactly once."""

from routing.load import LoadTracker


def test_dispatch_counts_request_prefill_tokens_and_prefilling_at_once():
    t = LoadTracker()
    a = t.start("p", prefill_tokens=100)
    t.start("p", prefill_tokens=50)
    load = t.get("p")
    assert (load.in_flight, load.prefill_tokens, load.prefilling) == (2, 150, 2)
    a.first_token()
    a.first_token()  # idempotent
    assert (load.in_flight, load.prefill_tokens, load.prefilling) == (2, 50, 1)
    a.finish()
    a.finish()  # idempotent
    assert (load.in_flight, load.prefill_tokens, load.prefilling) == (1, 50, 1)


def test_finishing_without_a_first_token_releases_everything():
    t = LoadTracker()
    r = t.start("p", prefill_tokens=70)
    r.finish()
    load = t.get("p")
    assert (load.in_flight, load.prefill_tokens, load.prefilling) == (0, 0, 0)
    assert r.finished
