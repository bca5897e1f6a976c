"""Sim-only fault injection for gateway tests (``POST /sim/faults``).

The next ``count`` generation requests fail the chosen way:
``error_500`` (HTTP 500 before any byte), ``hang`` (never answer), or
``drop_mid_stream`` (send the first chunk(s), then abort the connection);
``hang_tokenize`` makes the next ``count`` ``/tokenize`` calls never answer instead.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FaultMode = Literal["none", "error_500", "hang", "drop_mid_stream", "hang_tokenize"]
TOKENIZE_FAULTS = ("hang_tokenize",)


class FaultSpec(BaseModel):
    mode: FaultMode
    count: int = Field(default=1, ge=0, le=1_000_000)


class FaultInjector:
    """Counts down armed faults; one is consumed per generation request."""

    def __init__(self) -> None:
        self.mode: FaultMode = "none"
        self.remaining = 0
        self.fired: dict[str, int] = {}

    def arm(self, spec: FaultSpec) -> None:
        self.mode = spec.mode
        self.remaining = 0 if spec.mode == "none" else spec.count

    def take(self, tokenize: bool = False) -> FaultMode:
        """The fault for this request (``"none"`` once the armed ones are used up):
        generation faults for generation requests, tokenize faults for ``/tokenize``."""
        if self.remaining <= 0 or (self.mode in TOKENIZE_FAULTS) != tokenize:
            return "none"
        self.remaining -= 1
        self.fired[self.mode] = self.fired.get(self.mode, 0) + 1
        return self.mode

    def state(self) -> dict[str, object]:
        return {"mode": self.mode, "remaining": self.remaining, "fired": dict(self.fired)}
