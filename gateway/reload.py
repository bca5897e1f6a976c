"""Hot reload: new settings from the same sources as start-up, without a restart.

Three triggers reload a running gateway: ``SIGHUP``; a change of the ``--config``
file (``reload.watch_config``: its stat, polled, so a Kubernetes ConfigMap update,
which swaps a symlink, is seen too); and ``POST /admin/reload``. Each loads the
settings exactly as start-up did (the file, then ``KVGATE_*``, then the start-up
flags, which keep winning), validates all of it (the settings, then every strategy
and its options, built but not yet used) and only then applies it in one place,
``Gateway.reconfigure``. A config that fails any of it is rejected with a log line
saying why, and the running settings stay. Requests in flight finish with what they
started with; the KV index and the in-flight load counts stay.

What cannot change at runtime (``settings_diff.RESTART_ONLY``: the listeners, the
index backend, workers, ...) is logged as needing a restart and otherwise ignored.

With ``--workers N`` every worker reloads itself: the supervisor forwards ``SIGHUP``
to each, each watches the file, and ``POST /admin/reload`` (answered by one worker)
reaches the others over the host bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pydantic
import yaml
from prometheus_client import CollectorRegistry, Counter

from gateway import heap
from gateway.admission import check_admission
from gateway.config import Settings, SettingsSource
from gateway.settings_diff import changed_paths, needs_restart, runtime_settings
from routing.strategy_registry import build_strategy, canonical_name
from routing.strategy_set import StrategySet

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger("kvgate.reload")

SETTLE_S = 0.5  # a changed file must keep its stat this long before it is read


class ReloadRejected(Exception):
    """The new settings are not valid; the message says why (never a secret's value)."""


@dataclass(frozen=True)
class ReloadResult:
    """What one reload did: ``applied`` (``changed`` may be empty) or ``rejected``."""

    result: Literal["applied", "rejected"]
    changed: list[str] = field(default_factory=list)  # applied, by dotted path
    needs_restart: list[str] = field(default_factory=list)  # changed, but not applied
    reason: str = ""  # why it was rejected


class ReloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.reloads = Counter(
            "kvgate_config_reloads",
            "Configuration reloads, by result (applied, rejected).",
            ["result"],
            registry=registry,
        )
        for result in ("applied", "rejected"):
            self.reloads.labels(result)


@dataclass(frozen=True)
class NewSettings:
    """Settings loaded and validated for a running gateway, not yet applied."""

    loaded: Settings  # as the sources hold them (restart-only ones included)
    effective: Settings  # what the gateway applies: the running restart-only ones kept
    strategies: StrategySet  # built, unchanged ones reused


def validated(
    source: SettingsSource, running: Settings, strategies: StrategySet | None
) -> NewSettings:
    """The settings ``source`` holds now, as a gateway running ``running`` would apply
    them, with the strategies they name built over ``strategies``. Raises
    ``ReloadRejected`` when any of it is not valid."""
    try:
        loaded = source.load()
        effective = runtime_settings(running, loaded)
        built = build_strategies(effective, strategies)
        check_admission(effective)
    except Exception as exc:  # noqa: BLE001  (whatever is wrong, the running config stays)
        raise ReloadRejected(describe_error(exc)) from None
    return NewSettings(loaded, effective, built)


def build_strategies(settings: Settings, reuse: StrategySet | None = None) -> StrategySet:
    """The strategies ``settings`` name, built over ``reuse``. A strategy that refuses its
    options raises ValueError naming them (``strategy_options.kv-aware: ...``): what a
    strategy's constructor raises (a TypeError comparing a string with a number) does not
    say which setting it came from."""
    try:
        return StrategySet.build(settings.strategy, settings.strategy_options,
                                 settings.model_strategies, reuse=reuse)  # fmt: skip
    except Exception as exc:  # noqa: BLE001  (named below, then raised as ValueError)
        raise ValueError(_strategy_failure(settings, exc)) from None


def _strategy_failure(settings: Settings, exc: Exception) -> str:
    """Which configured strategy ``exc`` came from, found by building each alone."""
    for name in dict.fromkeys([settings.strategy, *settings.model_strategies.values()]):
        canonical, options = name, None
        try:
            canonical = canonical_name(name)
            options = settings.strategy_options.get(canonical)
            build_strategy(canonical, options)
        except Exception as own:  # noqa: BLE001  (this one's error, named)
            where = f"strategy_options.{canonical}" if options else f"strategy {name!r}"
            return f"{where}: {type(own).__name__}: {own}"
    return f"strategy: {type(exc).__name__}: {exc}"


def preflight(settings: Settings) -> None:
    """What start-up builds from ``settings`` beyond validating them (the strategies,
    every model's admission policy), built once before anything starts, so a bad value
    is one error at the command line, not a traceback from each worker it forks."""
    build_strategies(settings)
    check_admission(settings)


def describe_error(exc: BaseException) -> str:
    """Why a config was refused, without the values in it (keys and secrets)."""
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"bad YAML: {exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(exc, OSError):
        return f"cannot read the config file: {exc.strerror} ({exc.filename})"
    return f"{type(exc).__name__}: {exc}"[:500]


class Reloader:
    """One gateway process's reloads: the triggers, one reload at a time, the metric."""

    def __init__(self, gateway: Gateway, source: SettingsSource, metrics: ReloadMetrics) -> None:
        self._gw = gateway
        self._source = source
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # reload_soon's: 2 at most
        self._loop: asyncio.AbstractEventLoop | None = None  # set while started

    async def reload(self, trigger: str) -> ReloadResult:
        """Load, validate and apply the settings the sources hold now."""
        async with self._lock:
            gw = self._gw
            try:
                new = validated(self._source, gw.settings, gw.router.core.strategy_set)
            except ReloadRejected as exc:
                self._metrics.reloads.labels("rejected").inc()
                log.error("config reload (%s) rejected, the running settings stay: %s",
                          trigger, exc)  # fmt: skip
                return ReloadResult("rejected", reason=str(exc))
            paths = changed_paths(gw.settings, new.loaded)
            changed = [p for p in paths if not needs_restart(p)]
            restart = [p for p in paths if needs_restart(p)]
            if changed:
                try:
                    await gw.reconfigure(new.effective, new.strategies)
                except Exception:  # a bug: say so, loudly, with what was being applied
                    log.exception("config reload (%s) failed while applying %s", trigger,
                                  ", ".join(changed))  # fmt: skip
                    raise
                heap.settle()  # collect what the reload replaced, freeze what it built
            self._metrics.reloads.labels("applied").inc()
            log.info("config reloaded (%s): %s", trigger,
                     "changed " + ", ".join(changed) if changed else "nothing changed")  # fmt: skip
            if restart:
                log.warning("config reload (%s): %s changed but needs a restart; the running "
                            "value stays", trigger, ", ".join(restart))  # fmt: skip
            return ReloadResult("applied", changed, restart)

    async def reload_all_workers(self, trigger: str) -> ReloadResult:
        """``reload`` here, and have the sibling workers (``--workers N``) reload too."""
        result = await self.reload(trigger)
        siblings = self._gw.scale.siblings
        if siblings is not None:
            siblings.request_reload()
        return result

    def reload_soon(self, trigger: str) -> None:
        """``reload`` in a task of its own (from a signal handler or a bus message). One
        reload runs and one waits at most: the waiting one reads the sources as they are
        when it runs, so a burst of signals is one reload more, not one each."""
        if len(self._tasks) >= 2:
            return
        task = asyncio.get_running_loop().create_task(self._reload_logged(trigger))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload_logged(self, trigger: str) -> None:
        with contextlib.suppress(Exception):  # ``reload`` logged it
            await self.reload(trigger)

    # -- triggers ------------------------------------------------------------------------

    def sighup(self) -> None:
        """Called for the process's SIGHUP (``SIGHUPS``): reload soon."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.reload_soon, "SIGHUP")

    async def start(self) -> None:
        """Watch the config file; take sibling workers' reload requests; take SIGHUP.

        The running settings were read before this (then tokenizers warmed and the
        parts started, which can take minutes): a SIGHUP or a change of the file
        meanwhile, which the sibling workers apply, is applied now."""
        self._loop = asyncio.get_running_loop()
        missed_sighup = SIGHUPS.attach(self)
        siblings = self._gw.scale.siblings
        if siblings is not None:
            siblings.on_reload = lambda: self.reload_soon("a sibling worker was asked to")
        path = self._source.config_file
        if path is not None:  # the file as it is now: a change from here on is the watch's
            self._watch = asyncio.create_task(self._watch_file(path, file_signature(path)),
                                              name="kvgate-config-watch")  # fmt: skip
        if missed_sighup:
            self.reload_soon("SIGHUP while starting")
        elif path is not None and self._gw.settings.reload.watch_config and self._behind():
            self.reload_soon("config file changed while starting")

    def _behind(self) -> bool:
        """Whether the sources hold settings a reload would apply (or reject): they
        changed since the running settings were read."""
        gw = self._gw
        try:
            new = validated(self._source, gw.settings, gw.router.core.strategy_set)
        except ReloadRejected:
            return True  # valid when read: it changed, and ``reload`` says how
        return any(not needs_restart(p) for p in changed_paths(gw.settings, new.loaded))

    async def stop(self) -> None:
        SIGHUPS.detach(self)
        self._loop = None
        tasks = [t for t in (self._watch, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch_file(self, path: Path, seen: Signature | None) -> None:
        """Reload when ``path`` (through any symlinks) is another file or was written:
        its device, inode, size or mtime changed and then held still for ``SETTLE_S``."""
        while True:
            await asyncio.sleep(self._gw.settings.reload.watch_interval_s)
            if not self._gw.settings.reload.watch_config:
                continue
            now = file_signature(path)
            if now == seen:
                continue
            while True:  # a file being written: wait until it is whole
                await asyncio.sleep(SETTLE_S)
                settled = file_signature(path)
                if settled == now:
                    break
                now = settled
            seen = now
            with contextlib.suppress(Exception):  # logged by ``reload``; watching goes on
                await self.reload("config file changed")


class SighupRelay:
    """This process's SIGHUPs, passed to its running reloaders (``gateway.server``
    installs the handler before the settings are read). One that arrives while no
    reloader runs yet (a worker reads its settings, then warms its tokenizers and
    starts its parts) is kept for the next to start: the sibling workers reload on it,
    so this one must too."""

    def __init__(self) -> None:
        self._running: list[Reloader] = []
        self._missed = False

    def received(self) -> None:
        """From the signal handler (run by the main thread between two bytecodes)."""
        running = tuple(self._running)
        if not running:
            self._missed = True
        for reloader in running:
            reloader.sighup()

    def attach(self, reloader: Reloader) -> bool:
        """``reloader`` takes the SIGHUPs from now on; True if one came while none ran."""
        self._running.append(reloader)
        missed, self._missed = self._missed, False
        return missed

    def detach(self, reloader: Reloader) -> None:
        with contextlib.suppress(ValueError):
            self._running.remove(reloader)


SIGHUPS = SighupRelay()

Signature = tuple[int, int, int, int]


def file_signature(path: Path) -> Signature | None:
    """What tells one version of a file from another; None while it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def latest_settings(source: SettingsSource | None, started: Settings) -> Settings:
    """The settings for a worker the supervisor (re)starts: what ``source`` holds now,
    as a reload would apply it to a gateway started with ``started`` (so a restarted
    worker runs what its siblings reloaded); ``started`` if that is not valid."""
    if source is None:
        return started
    try:
        return validated(source, started, None).effective
    except ReloadRejected as exc:
        log.error("the settings source is not valid (%s): the worker starts with the "
                  "settings read at start-up", exc)  # fmt: skip
        return started
