"""Strategy factory: strategies register themselves by name; config picks one.

Adding a strategy is one new file in ``routing/strategies/`` whose ``Strategy``
subclass is decorated with ``@register("name", aliases=...)``; every module in that
package is imported on first lookup, so nothing else needs editing.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from routing.types import Strategy

S = TypeVar("S", bound=type[Strategy])

_FACTORIES: dict[str, type[Strategy]] = {}
_ALIASES: dict[str, str] = {}
_loaded = False


def register(name: str, aliases: tuple[str, ...] = ()) -> Callable[[S], S]:
    """Class decorator: make ``cls`` buildable as ``name`` (and its aliases); sets ``cls.name``."""

    def decorate(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"@register({name!r}) needs a routing.types.Strategy subclass")
        for key in (name, *aliases):
            taken = _FACTORIES.get(_ALIASES.get(key, key))
            if taken is not None and taken is not cls:
                raise ValueError(f"strategy name {key!r} is already {taken.__name__}'s")
        cls.name = name
        _FACTORIES[name] = cls
        for alias in aliases:
            _ALIASES[alias] = name
        return cls

    return decorate


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    import routing.strategies as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")
    _loaded = True


def canonical_name(name: str) -> str:
    """Resolve aliases (HyperPod spells ``roundrobin``, ``kvaware`` ...)."""
    _load_all()
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in _FACTORIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(available())}")
    return key


def available() -> list[str]:
    _load_all()
    return sorted(_FACTORIES)


def build_strategy(name: str, options: Mapping[str, Any] | None = None) -> Strategy:
    """Instantiate a strategy by (alias) name with keyword options from config."""
    return _FACTORIES[canonical_name(name)](**dict(options or {}))
