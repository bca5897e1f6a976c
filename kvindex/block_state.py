"""A block key's holders in ``MemoryStore``: one immutable tuple, and the writes' transitions.

``State = (l0, l1, l2, spec)``: the pod slots holding the block in L0 and in L1 as
int bitmasks, the pod that wrote its fleet-wide L2 copy (or None), and the
speculative L0 holders as ``((slot, deadline), ...)`` (or None, never empty). A
state is never mutated: a write computes the next one (``stored``, ``removed``),
so keys changed alike by one op can share it, and a lookup can fold equal
neighbours without reading them one by one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

Spec = tuple[tuple[int, float], ...]  # (slot, deadline) of each speculative L0 holder
State = tuple[int, int, str | None, Spec | None]  # l0 slots, l1 slots, L2 writer, spec


def bits(mask: int) -> Iterable[int]:
    """Slot numbers of the set bits of ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


# Speculation deadlines are rounded up to this step (a power of two: exact in binary).
# A prefix speculated again within one step then leaves its keys' states as they
# are (the same deadline): a hot system prompt or a conversation's earlier turns,
# re-sent many times a second, is touched, not rewritten key by key.
DEADLINE_STEP_S = 0.125


def spec_deadline(now: float, ttl_s: float) -> float:
    """When a speculation made at ``now`` for ``ttl_s`` ends: at most one step late
    (a TTL of 0 or less ends at once, as it says)."""
    if ttl_s <= 0:
        return now + ttl_s
    return math.ceil((now + ttl_s) / DEADLINE_STEP_S) * DEADLINE_STEP_S


def spec_slots(spec: Spec | None) -> int:
    """Bitmask of the slots with speculation, live or expired."""
    return sum(1 << slot for slot, _ in spec) if spec else 0


def live_slots(spec: Spec, now: float) -> int:
    """Bitmask of the slots whose speculation is still live at ``now``."""
    return sum(1 << slot for slot, deadline in spec if deadline > now)


def spec_without(spec: Spec | None, slot: int) -> Spec | None:
    if spec is None or not (spec_slots(spec) >> slot) & 1:
        return spec
    return tuple(p for p in spec if p[0] != slot) or None


def spec_with(spec: Spec | None, slot: int, deadline: float) -> Spec:
    rest = tuple(p for p in spec if p[0] != slot) if spec else ()
    return (*rest, (slot, deadline))


def speculated(old: State, slot: int, deadline: float) -> State:
    """``old`` with ``slot`` speculating until ``deadline``; ``old`` itself when it
    already does (speculated again within one deadline step)."""
    spec = old[3]
    if spec is not None and (slot, deadline) in spec:
        return old
    return (old[0], old[1], old[2], spec_with(spec, slot, deadline))


def stored(old: State, slot: int, bit: int, is_l0: bool) -> tuple[State, State, int]:
    """(old, new, 1 if the pod gained the tier) for a ``Stored`` L0/L1 of this slot;
    ``new is old`` when nothing changes."""
    l0, l1, writer, spec = old
    if is_l0:
        new = (l0 | bit, l1, writer, spec_without(spec, slot))  # confirmed by the engine
        return old, (old if new == old else new), int(not l0 & bit)
    if l1 & bit:
        return old, old, 0
    return old, (l0, l1 | bit, writer, spec), 1


def removed(old: State, slot: int, bit: int, is_l0: bool) -> tuple[State, State, int]:
    """(old, new, 1 if the pod lost the tier) for a ``Removed`` L0/L1 of this slot."""
    l0, l1, writer, spec = old
    if is_l0:
        new = (l0 & ~bit, l1, writer, spec_without(spec, slot))
        return old, (old if new == old else new), int(bool(l0 & bit))
    if not l1 & bit:
        return old, old, 0
    return old, (l0, l1 & ~bit, writer, spec), 1
