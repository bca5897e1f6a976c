"""Memory stays bounded: every structure reports its size and bound, and a pod that
leaves the fleet takes its load counters, metric series and engine state with it."""

from __future__ import annotations

from tests.inproc.harness import inproc_gateway


async def test_admin_bounds_lists_every_structure_under_its_capacity(pod_a):
    async with inproc_gateway(pod_a, strategy="prefix-aware") as g:
        assert (await g.chat()).status_code == 200
        body = (await g.admin.get("/admin/bounds")).json()
        structures = body["structures"]
        assert {"index", "load.pods", "prefix-aware.prefixes", "speculations_pending",
                "model_cards[pod-a]"} <= set(structures)  # fmt: skip
        for name, b in structures.items():
            assert 0 <= b["size"] <= b["capacity"], name
            assert b["worst_case_bytes"] == b["capacity"] * b["bytes_each"] > 0, name
        assert structures["prefix-aware.prefixes"]["size"] > 0  # the request was remembered
        assert body["process"]["rss_bytes"] > 10_000_000 and body["process"]["open_fds"] > 0


async def test_a_removed_pod_leaves_no_load_counters_or_metric_series(pod_a, pod_b):
    async with inproc_gateway(pod_a, pod_b) as g:
        for _ in range(2):
            assert (await g.chat()).status_code == 200
        assert g.metric("kvgate_requests_total", pod="pod-a") == 1
        await g.gw.registry.remove("pod-a")
        exposition = "".join(str(s) for family in g.gw.prometheus.collect() for s in family.samples)
        assert "pod-a" not in exposition
        assert "pod-a" not in g.gw.router.core.load
        assert g.metric("kvgate_requests_total", pod="pod-b") == 1


async def test_a_removed_pod_leaves_kv_awares_pod_speeds(pod_a, pod_b):
    from gateway.scale_out import kv_aware_strategies

    async with inproc_gateway(pod_a, pod_b, strategy="kv-aware") as g:
        (kv,) = kv_aware_strategies(g.gw.router.core)
        assert kv.speeds is not None
        for _ in range(8):  # pod-a takes twice the average pod's time, pod-b half
            kv.speeds.observe("m", "pod-a", observed_s=0.2, predicted_s=0.1)
            kv.speeds.observe("m", "pod-b", observed_s=0.05, predicted_s=0.1)
        assert kv.speeds.factor("m", "pod-b") < 1.0
        await g.gw.registry.remove("pod-a")
        assert kv.speeds.of_pod("pod-a") == {}
        assert kv.speeds.factor("m", "pod-b") == 1.0  # the only pod left: the average


async def test_a_local_tokenizers_caches_are_listed_with_what_they_hold(pod_a):
    from bench.tinymodel import ensure_tokenizer
    from tests.inproc.scripted_pod import MODEL

    models = {MODEL: {"block_size": 32, "tokenizer": str(ensure_tokenizer())}}
    async with inproc_gateway(pod_a, strategy="kv-aware", models=models) as g:
        assert (await g.chat()).status_code == 200
        structures = (await g.admin.get("/admin/bounds")).json()["structures"]
        words = structures[f"word_cache[{MODEL}]"]
        assert words["capacity"] == 50_000 and words["size"] > 0  # the chat's words
        assert structures[f"token_cache[{MODEL}]"]["size"] > 0
