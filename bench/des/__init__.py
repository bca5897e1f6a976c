"""Discrete-event fleet simulator: kvgate's routing strategies in simulated time.

The same ``routing`` strategy objects, ``LoadTracker`` and ``kvindex`` memory store
as the live gateway, and the same pod model (``bench.podmodel``) as the live
simulated pod, driven by a heap of timed events instead of HTTP. A 16-pod fleet
replays an hour of trace in seconds to a minute.

    from bench.des.sim import run_des
    results = run_des(requests, n_pods=16, strategy="kv-aware", profile="original",
                      tiers="L0+L1+L2")
"""
