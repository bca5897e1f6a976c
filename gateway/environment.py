"""Which ``KVGATE_*`` environment variables are kvgate's settings, and which are not.

The gateway reads its settings from ``KVGATE_<SETTING>`` (``__`` between a section and
its key). Two other kinds of variable share the prefix:

* **Kubernetes service links.** The kubelet gives every container, for every Service
  in its namespace, Docker-link variables named after the Service: a Service named
  ``kvgate`` (the one our manifests ship) yields ``KVGATE_SERVICE_HOST``,
  ``KVGATE_PORT=tcp://10.96.0.12:80``, ``KVGATE_PORT_80_TCP_ADDR`` ..., and
  ``kvgate-redis`` yields ``KVGATE_REDIS_PORT=tcp://...``. ``KVGATE_PORT`` is also the
  name of the ``port`` setting, so read as one it stopped every gateway pod at start
  ("port: Input should be a valid integer"). A variable is taken for a service link
  by its name *and* its value (``KVGATE_PORT=9000`` is the setting,
  ``KVGATE_PORT=tcp://10.96.0.12:80`` is not), and is then no setting at all.
* **kvgate's other commands' variables** (``TOOL_VARIABLES``): the benchmarks', the
  index CLI's and the setup scripts'.

Anything else under the prefix is a mistake the gateway would otherwise ignore in
silence (``KVGATE_STRATGY=kv-aware`` serving round-robin): ``check_environment``
refuses it, naming the setting it most likely meant, as a misspelt key in the config
file is refused.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

from pydantic import BaseModel

PREFIX = "KVGATE_"
NESTED = "__"

# Read by kvgate's other commands, never by ``kvgate serve``.
TOOL_VARIABLES = frozenset(
    {
        "KVGATE_ADMIN_URL",  # kvgate index: the admin listener
        "KVGATE_ADMIN_KEY",  # kvgate index: its key
        "KVGATE_CACHE_DIR",  # benchmarks and tests: the tiny model's files
        "KVGATE_KEEP_LOGS",  # benchmarks and tests: keep started processes' logs
        "KVGATE_PEERS_HOME",  # benchmarks: where the peer routers are installed
        "KVGATE_TRACE",  # benchmarks: the Mooncake trace
        "KVGATE_TREE",  # bench/profile_gateway.sh: an older checkout's gateway
        "KVGATE_VLLM_VENV",  # scripts/ensure_vllm_venv.sh and the e2e tests
        "KVGATE_VLLM_PYTHON",
        "KVGATE_VLLM_SPEC",
        "KVGATE_PYTHON",
    }
)

_SERVICE = r"KVGATE(?:_[A-Z0-9_]+)?"  # a Service kvgate or kvgate-*, upper-cased, "-" as "_"
_PORT = rf"{_SERVICE}_PORT_\d+_(?:TCP|UDP|SCTP)"
_ADDRESS = re.compile(r"(?:tcp|udp|sctp)://\S+:\d+")
_NUMBER = re.compile(r"\d+")
_ANY = re.compile(r".*", re.S)
# (name, the value such a link has): the kubelet's SERVICE_HOST/SERVICE_PORT pair and
# its Docker-link variables (makeLinkVariables).
_LINKS: tuple[tuple[re.Pattern[str], re.Pattern[str]], ...] = (
    (re.compile(rf"{_SERVICE}_SERVICE_HOST"), _ANY),
    (re.compile(rf"{_SERVICE}_SERVICE_PORT(?:_[A-Z0-9_]+)?"), _NUMBER),
    (re.compile(rf"{_SERVICE}_PORT|{_PORT}"), _ADDRESS),
    (re.compile(rf"{_PORT}_PROTO"), re.compile(r"tcp|udp|sctp")),
    (re.compile(rf"{_PORT}_PORT"), _NUMBER),
    (re.compile(rf"{_PORT}_ADDR"), _ANY),
)


def is_service_link(name: str, value: str) -> bool:
    """Whether ``name=value`` is a Kubernetes service link of a Service named
    ``kvgate`` or ``kvgate-*`` rather than a setting."""
    name = name.upper()
    return any(link.fullmatch(name) and shape.fullmatch(value) for link, shape in _LINKS)


def setting_names(settings_cls: type[BaseModel]) -> list[str]:
    """Every ``KVGATE_*`` name a setting is read from: the top-level settings and the
    keys of their sections."""
    names = []
    for field, info in settings_cls.model_fields.items():
        names.append(PREFIX + field.upper())
        section = info.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            names += [
                f"{PREFIX}{field.upper()}{NESTED}{key.upper()}" for key in section.model_fields
            ]
    return names


def unknown_variables(
    environ: Mapping[str, str], settings_cls: type[BaseModel]
) -> list[tuple[str, str | None]]:
    """``(name, the setting it most likely meant or None)`` for every ``KVGATE_*``
    variable that is neither a setting, nor a service link, nor a tool's. A section's
    unknown key (``KVGATE_TIMEOUTS__CONECT_S``) is left to the settings' own check."""
    fields = {name.lower() for name in settings_cls.model_fields}
    candidates: list[str] | None = None
    unknown = []
    for name, value in environ.items():
        upper = name.upper()
        if not upper.startswith(PREFIX) or upper in TOOL_VARIABLES:
            continue
        if upper[len(PREFIX) :].split(NESTED, 1)[0].lower() in fields:
            continue
        if is_service_link(upper, value):
            continue
        if candidates is None:  # compared without the prefix every name shares
            candidates = [n[len(PREFIX) :] for n in setting_names(settings_cls)]
        close = difflib.get_close_matches(upper[len(PREFIX) :], candidates, n=1, cutoff=0.8)
        unknown.append((name, PREFIX + close[0] if close else None))
    return sorted(unknown)


def check_environment(environ: Mapping[str, str], settings_cls: type[BaseModel]) -> None:
    """Refuse ``KVGATE_*`` variables that are no setting (``unknown_variables``)."""
    unknown = unknown_variables(environ, settings_cls)
    if unknown:
        raise ValueError("; ".join(_described(unknown)))


def _described(unknown: Iterable[tuple[str, str | None]]) -> list[str]:
    return [
        f"{name} is not a setting" + (f" (did you mean {meant}?)" if meant else "")
        for name, meant in unknown
    ]
