"""/ready's warm start: it waits for the replay of every followed pod, once."""

from __future__ import annotations

from gateway.warm_start import WarmStart


class _Index:
    """The two things WarmStart asks the KV index."""

    def __init__(self):
        self.replayed: dict[str, bool] = {}

    def followed_pods(self):
        return list(self.replayed)

    def history_replayed(self, pod):
        return self.replayed.get(pod)


def test_ready_waits_for_every_followed_pods_replay_then_never_again():
    kv = _Index()
    kv.replayed = {"a": True, "b": False, "c": False}
    warm = WarmStart(kv, shared_index=False)
    assert (warm.warming(), warm.state) == (["b", "c"], "warming")

    kv.replayed.update(b=True, c=True)
    assert (warm.warming(), warm.state) == ([], "warm")

    kv.replayed["late"] = False  # a pod that joins a ready gateway
    assert (warm.warming(), warm.state) == ([], "warm")


def test_a_shared_index_is_warm_at_once():
    kv = _Index()
    kv.replayed = {"a": False}
    warm = WarmStart(kv, shared_index=True)
    assert (warm.warming(), warm.state) == ([], "shared")
