"""Record real vLLM KV-event batches for the offline decoder tests.

Usage (vLLM venv from scripts/ensure_vllm_venv.sh; starts its own small server):

    .venv/bin/python -m tests.e2e.record_vllm_events [--out tests/data/vllm-events]

The server gets a 64-block KV cache (``--num-gpu-blocks-override 64``) so that a
few requests force evictions and vLLM publishes ``BlockRemoved``, and dev mode so
``POST /reset_prefix_cache`` publishes ``AllBlocksCleared``. Each scenario writes
one ``vllm-<version>-<scenario>.msgpack`` holding a msgpack map::

    {"vllm_version", "model", "block_size",
     "requests": [{"endpoint", "cache_salt", "token_ids", "prompt_tokens",
                   "cached_tokens"}],
     "frames": [[topic bytes, seq bytes, payload bytes], ...]}   # exactly as received

Prompts are synthetic filler (tests/e2e/prompts.py); only token ids are stored.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from bench.vllm_pods import (
    BLOCK_SIZE,
    MODEL_NAME,
    REPO_ROOT,
    VllmServer,
    ensure_tiny_model,
    vllm_python,
)
from tests.e2e import kv_events
from tests.e2e.prompts import prompt_text

SMALL_CACHE_BLOCKS = 64
Recorder = Callable[[dict[str, Any], str | None], None]


def send(srv: VllmServer, endpoint: str, body: dict[str, Any], salt: str | None) -> dict:
    """One request with max_tokens=1; returns the record kept beside the frames."""
    keys = ("messages", "prompt")
    tok = httpx.post(
        f"{srv.url}/tokenize",
        json={"model": MODEL_NAME, **{k: v for k, v in body.items() if k in keys}},
        timeout=30,
    ).json()
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    req = {"model": MODEL_NAME, **body, "max_tokens": 1}
    if salt is not None:
        req["cache_salt"] = salt
    usage = httpx.post(f"{srv.url}{path}", json=req, timeout=60).json()["usage"]
    return {
        "endpoint": endpoint,
        "cache_salt": salt,
        "token_ids": tok["tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


def chat_extend(srv: VllmServer, rec: Recorder) -> None:
    """A chat turn, then the same conversation one turn longer (parent links)."""
    first = [{"role": "user", "content": prompt_text("chat-extend", 80)}]
    rec({"messages": first}, None)
    longer = first + [
        {"role": "assistant", "content": prompt_text("reply", 10)},
        {"role": "user", "content": prompt_text("follow-up", 40)},
    ]
    rec({"messages": longer}, None)


def completions_salt(srv: VllmServer, rec: Recorder) -> None:
    """The same prompt without and with cache_salt, then salted again (a hit)."""
    body = {"prompt": prompt_text("salted", 60)}
    rec(body, None)
    rec(body, "tenant-a")
    rec(body, "tenant-a")


def eviction(srv: VllmServer, rec: Recorder) -> None:
    """Distinct prompts that overflow the 64-block cache: BlockRemoved appears."""
    for i in range(6):
        rec({"prompt": prompt_text(f"evict-{i}", 200)}, None)


def reset(srv: VllmServer, rec: Recorder) -> None:
    """POST /reset_prefix_cache between two requests: AllBlocksCleared.

    The engine queues the event and publishes it with the next step's batch, so
    it only shows up once another request runs.
    """
    rec({"prompt": prompt_text("before-reset", 30)}, None)
    httpx.post(f"{srv.url}/reset_prefix_cache", timeout=30).raise_for_status()
    rec({"prompt": prompt_text("before-reset", 30)}, None)


SCENARIOS: dict[str, tuple[str, Callable[[VllmServer, Recorder], None]]] = {
    "chat-extend": ("chat", chat_extend),
    "completions-salt": ("completions", completions_salt),
    "eviction": ("completions", eviction),
    "reset": ("completions", reset),
}


def run_scenario(
    srv: VllmServer, ctx: zmq.Context, endpoint: str, scenario: Callable[..., None]
) -> tuple[list[dict], list[kv_events.Frame]]:
    """Run one scenario with a fresh subscriber; return its requests and frames."""
    sub = kv_events.subscribe(ctx, srv.events_endpoint)
    requests: list[dict] = []

    def rec(body: dict[str, Any], salt: str | None) -> None:
        requests.append(send(srv, endpoint, body, salt))

    scenario(srv, rec)
    frames = kv_events.drain(sub)
    sub.close()
    return requests, frames


def record(srv: VllmServer, version: str, out_dir: Path) -> list[Path]:
    ctx = zmq.Context()
    written = []
    try:
        for name, (endpoint, scenario) in SCENARIOS.items():
            requests, frames = run_scenario(srv, ctx, endpoint, scenario)
            doc = {
                "vllm_version": version,
                "model": MODEL_NAME,
                "block_size": BLOCK_SIZE,
                "requests": requests,
                "frames": [[f.topic, f.seq_bytes, f.payload] for f in frames],
            }
            path = out_dir / f"vllm-{version}-{name}.msgpack"
            path.write_bytes(msgspec.msgpack.encode(doc))
            written.append(path)
            print(f"{path.name}: {len(requests)} requests, {len(frames)} frames")
    finally:
        ctx.destroy(linger=0)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "data" / "vllm-events")
    args = p.parse_args(argv)
    py = vllm_python()
    args.out.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.mkdtemp(prefix="kvgate-record-")) / "vllm.log"
    srv = VllmServer(
        py,
        ensure_tiny_model(py),
        log,
        extra_args=[
            "--num-gpu-blocks-override",
            str(SMALL_CACHE_BLOCKS),
            "--max-model-len",
            "1024",
        ],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    with srv:
        srv.start().wait_ready()
        version = httpx.get(f"{srv.url}/version", timeout=10).json()["version"]  # "0.32.0"
        record(srv, ".".join(version.split(".")[:2]), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
