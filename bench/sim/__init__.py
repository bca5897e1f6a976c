"""A simulated vLLM 0.32 pod: same OpenAI API, metrics and KV-event wire format.

It stands in for what a CPU machine cannot provide (GPU timing, many pods, cache
tiers) so the gateway can be tested and benchmarked at fleet scale.
"""

from bench.sim.config import KVEventsSettings, SimConfig

__all__ = ["KVEventsSettings", "SimConfig"]
