"""Simulated pods (KV events on) with a real gateway in front: what most integration
tests start, in one place."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx

from bench.gateway_proc import GatewayURL, run_gateway
from bench.sim.launch import SimPod, sim_fleet
from bench.tinymodel import MODEL_NAME, ensure_tokenizer

BLOCK = 32


def model_env(tokenizer: str = "local", block_size: int = BLOCK, **extra: str) -> dict[str, str]:
    """``KVGATE_*`` settings for the tiny model: its block size and how it is tokenized
    (``local``: the pods' own tokenizer files; ``engine``: each pod's ``/tokenize``)."""
    model: dict[str, Any] = {"block_size": block_size}
    if tokenizer == "local":
        model["tokenizer"] = str(ensure_tokenizer())
    else:
        model["tokenizer_mode"] = tokenizer
    return {"KVGATE_MODELS": json.dumps({MODEL_NAME: model}), **extra}


def system_chat(gw: str, model: str, system: str) -> httpx.Response:
    """A chat of one system prompt and a one-word question: what the drills send to
    see a prompt's prefix cached and predicted."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    body = {"model": model, "max_tokens": 2, "messages": messages}
    return httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=30)


def pod_spec(pod: SimPod, replay: bool = False) -> tuple[str, str]:
    """``(name, url,events=...[,replay=...])`` for ``run_gateway``."""
    spec = f"{pod.url},events={pod.events_endpoint}"
    return pod.name, spec + (f",replay={pod.replay_endpoint}" if replay else "")


@contextlib.contextmanager
def sim_pods_and_gateway(
    n: int, strategy: str, env: dict[str, str], **pod_config: Any
) -> Iterator[tuple[list[SimPod], GatewayURL]]:
    """``n`` simulated pods publishing KV events, and a gateway following them."""
    config = {"block_size": BLOCK, "itl_s": 0.001, "default_max_tokens": 2, **pod_config}
    with (
        sim_fleet(n, kv_events=True, **config) as pods,
        run_gateway([pod_spec(p) for p in pods], strategy, env=env) as gw,
    ):
        yield pods, gw
