"""Other routers run side by side with kvgate: vllm-router and sglang-router.

Each is installed from PyPI on demand into its own venv under
``~/.cache/kvgate/peers/<name>`` (they pin their own dependencies), at the version
whose flags were checked (``PeerSpec.version``; bump it after checking a newer
``--help``; a venv holding another version is reinstalled), started in
front of the same pods with its cache-aware policy, and measured by the same
load generator. When one cannot be installed or started, ``PeerUnavailable``
carries the reason, and the report prints that reason instead of numbers.

Policies used (checked against ``--help`` of vllm-router 0.1.17, sglang-router 0.3.2):
- vllm-router ``--policy kv_aware`` with ``--kv-event-source URL=tcp://…`` (and
  replay) per pod, ``--kv-event-block-size`` and ``--kv-event-model``: its own
  KV-event index, the closest match to kvgate's kv-aware.
- sglang-router ``--policy cache_aware``: an approximate radix tree over request
  text per worker, load-balanced by thresholds; it takes no KV events.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.logfiles import log_file
from bench.polling import http_status, wait_for
from bench.ports import free_port
from bench.processes import stop


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message says why (it goes into the report)."""


@dataclass(frozen=True)
class PodEndpoint:
    url: str
    events: str | None = None
    replay: str | None = None


@dataclass(frozen=True)
class PeerSpec:
    name: str
    package: str
    version: str  # installed as package==version
    policy: str
    entry: tuple[str, ...]  # argv prefix relative to the venv's bin/


PEERS: dict[str, PeerSpec] = {
    "vllm-router": PeerSpec("vllm-router", "vllm-router", "0.1.17", "kv_aware", ("vllm-router",)),
    "sglang-router": PeerSpec(
        "sglang-router",
        "sglang-router",
        "0.3.2",
        "cache_aware",
        ("python", "-m", "sglang_router.launch_router"),
    ),
}


def peers_home() -> Path:
    return Path(os.environ.get("KVGATE_PEERS_HOME", Path.home() / ".cache/kvgate/peers"))


def ensure_peer(name: str, install_timeout_s: float = 600.0) -> Path:
    """The peer's venv bin/ directory, installing it on first use."""
    spec = PEERS.get(name)
    if spec is None:
        raise PeerUnavailable(f"unknown peer {name!r} (known: {', '.join(PEERS)})")
    venv = peers_home() / name
    bin_dir = venv / "bin"
    if (bin_dir / spec.entry[0]).exists() and peer_version(name) == spec.version:
        return bin_dir
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run(
            [str(bin_dir / "pip"), "install", "-q", f"{spec.package}=={spec.version}"],
            check=True,
            timeout=install_timeout_s,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"pip install {spec.package} failed: {tail[0][:160]}") from None
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise PeerUnavailable(f"installing {spec.package}: {exc!r}"[:200]) from None
    return bin_dir


def peer_version(name: str) -> str | None:
    """Installed version of the peer's package, or None when not installed."""
    spec = PEERS[name]
    python = peers_home() / name / "bin" / "python"
    if not python.exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({spec.package!r}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or None if out.returncode == 0 else None


def peer_command(
    name: str,
    bin_dir: Path,
    port: int,
    pods: list[PodEndpoint],
    model: str,
    block_size: int,
    policy: str | None = None,
) -> list[str]:
    """The peer's command line; ``policy`` replaces its default (``PeerSpec.policy``)."""
    spec = PEERS[name]
    policy = policy or spec.policy
    cmd = [str(bin_dir / spec.entry[0]), *spec.entry[1:]]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--worker-urls", *[p.url for p in pods], "--prometheus-port", str(free_port())]
    if name == "vllm-router" and policy == "kv_aware":
        # vllm-router refuses KV event sources with any other policy.
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        for p in pods:
            if p.events:
                cmd += ["--kv-event-source", f"{p.url}={p.events}"]
            if p.replay:
                cmd += ["--kv-event-replay-source", f"{p.url}={p.replay}"]
    if name == "vllm-router":
        cmd += ["--log-level", "warning"]
    else:
        cmd += ["--log-level", "warn"]
    return cmd


def _wait_serving(
    url: str, model: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float
) -> None:
    """Until the peer answers a request, not only its own /health: sglang-router's
    /health passes before its first probe of the workers, and until then every request
    gets 503 "no available workers" (a benchmark's first requests would fail)."""
    probe = {"model": model, "messages": [{"role": "user", "content": "ready?"}],
             "max_tokens": 1}  # fmt: skip

    def serving() -> bool:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise PeerUnavailable(f"exited with {proc.returncode}: {tail[0][-160:]}")
        if http_status(f"{url}/health") != 200:
            return False
        try:
            return (
                httpx.post(f"{url}/v1/chat/completions", json=probe, timeout=10).status_code == 200
            )
        except httpx.HTTPError:
            return False

    try:
        wait_for(serving, timeout_s, what="serving", poll=0.25)
    except TimeoutError:
        raise PeerUnavailable(f"not serving within {timeout_s:.0f}s (log {log})") from None


class PeerURL(str):
    """The peer's base URL (a plain ``str``) carrying its process id, so that a
    benchmark can read the CPU it spends (``bench.gateway_cpu``)."""

    pid: int

    def __new__(cls, url: str, pid: int) -> PeerURL:
        obj = super().__new__(cls, url)
        obj.pid = pid
        return obj


@contextlib.contextmanager
def run_peer(
    name: str,
    pods: list[PodEndpoint],
    model: str,
    block_size: int,
    timeout_s: float = 60.0,
    policy: str | None = None,
) -> Iterator[PeerURL]:
    """Start the peer in front of ``pods``; yield its base URL; stop it on exit."""
    bin_dir = ensure_peer(name)
    port = free_port()
    log = log_file(f"kvgate-peer-{name}-")
    cmd = peer_command(name, bin_dir, port, pods, model, block_size, policy)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = PeerURL(f"http://127.0.0.1:{port}", proc.pid)
    try:
        _wait_serving(url, model, proc, log, timeout_s)
        yield url
    finally:
        stop(proc)
