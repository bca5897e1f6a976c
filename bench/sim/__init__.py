"""A simulated vLLM 0.32 pod: same OpenAI API, metrics and KV-event wire format.

It stands in for what a CPU machine cannot provide (GPU timing, many pods, cache
tiers) so the gateway can be tested and benchmarked at fleet scale. Import the
modules directly (``bench.sim.config.SimConfig``): this package stays empty so
the pure ``bench.podmodel`` can use ``bench.sim.cache`` without import cycles.
"""
