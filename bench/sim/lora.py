"""LoRA adapters of a simulated pod: names the API answers to, as vLLM 0.32 serves them.

An adapter shares the base model's weights and tokenizer; what it changes for the
simulation is the prefix cache: vLLM puts the adapter's name in every block's
hash (``lora_name`` in ``BlockStored`` and in each block's extra keys), so the same
prompt under two adapters (or an adapter and the base model) shares nothing.
``/v1/models`` lists each adapter with its ``parent``; with runtime updating
allowed (vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) adapters are loaded and
unloaded through ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
"""

from __future__ import annotations

from collections.abc import Iterable


class LoraLimit(ValueError):
    """No room for another adapter."""


class LoraAdapters:
    """Adapter name -> vLLM's ``lora_id`` (1, 2, ... in load order), bounded."""

    def __init__(self, names: Iterable[str], capacity: int) -> None:
        self.capacity = capacity
        self._ids: dict[str, int] = {}
        self._next_id = 1
        for name in names:
            self.load(name)

    def __contains__(self, name: object) -> bool:
        return name in self._ids

    def names(self) -> list[str]:
        return list(self._ids)

    def get(self, name: str) -> tuple[int, str] | None:
        """``(lora_id, name)`` as the engine's events carry them, None if not loaded."""
        lora_id = self._ids.get(name)
        return None if lora_id is None else (lora_id, name)

    def load(self, name: str) -> bool:
        """Register ``name``; False when it already was."""
        if name in self._ids:
            return False
        if len(self._ids) >= self.capacity:
            raise LoraLimit(f"at most {self.capacity} LoRA adapters can be loaded")
        self._ids[name] = self._next_id
        self._next_id += 1
        return True

    def unload(self, name: str) -> bool:
        """Forget ``name``; False when it was not loaded."""
        return self._ids.pop(name, None) is not None
