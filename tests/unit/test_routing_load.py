"""LoadTracker: load counted at dispatch, released exactly once."""

from routing.core import Candidate, RoutingCore
from routing.load import CombinedLoad, LoadTracker, LoadView, PodLoad


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


# -- the seam: a view that adds what other routers dispatched ------------------------


class _Others:
    """A LoadSource with fixed counts for other routers."""

    def __init__(self, counts):
        self.counts = counts

    def others(self, pod):
        return self.counts.get(pod)


def test_combined_view_adds_other_routers_load_to_this_routers_own():
    local = LoadTracker()
    host = _Others({"p": PodLoad(2, 300, 1)})
    fleet = _Others({"p": PodLoad(1, 0, 0), "q": PodLoad(4, 8, 2)})
    view = CombinedLoad(local, {"host": host, "fleet": fleet})
    r = view.start("p", prefill_tokens=100)
    assert view.get("p") == PodLoad(4, 400, 2)
    assert view.get("q") == PodLoad(4, 8, 2)
    assert view.get("unknown") == PodLoad()
    r.finish()
    assert view.get("p") == PodLoad(3, 300, 1)
    assert local.get("p") == PodLoad()  # only this router's own counts live locally


def test_the_routing_core_reads_and_counts_through_its_load_view():
    core = RoutingCore.from_config("least-loaded")
    core.set_load(CombinedLoad(LoadTracker(), {"fleet": _Others({"a": PodLoad(5, 0, 0)})}))
    req = core.request("m")
    routed = core.route(req, [Candidate("a"), Candidate("b")], None)
    assert routed.pod == "b"  # "a" is busy with other routers' requests
    assert core.load.get("b").in_flight == 1


def test_a_trackers_snapshot_lists_busy_pods_only_and_is_a_copy():
    t = LoadTracker()
    t.start("p", 10)
    t.start("q").finish()
    snap = t.snapshot()
    assert snap == {"p": PodLoad(1, 10, 1)}
    snap["p"].add(5, 5, 5)
    assert t.get("p") == PodLoad(1, 10, 1)


def test_a_view_implements_the_load_view_protocol():
    assert isinstance(LoadTracker(), LoadView)
    assert isinstance(CombinedLoad(LoadTracker(), {}), LoadView)
