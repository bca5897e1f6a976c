"""The Redis value format: the Lua that writes it and the Python that reads it.

Value of one block key (a plain string, so a lookup reads thousands with one MGET)::

    <l2 writer pod id or empty>|<pod id>=<x>;<pod id>=<x>...

Pod ids are 8-character hashes of the pod name (``RedisStore.pod_id``); the
registry hash ``{kvgate:<ns>}:pods`` maps them back to names. Why not the names
themselves: real pod names are ~40 bytes, and value size is most of what a
lookup pays per key (a 2048-key walk measured +40% with such names).

``x = bits + 4 * spec_deadline_ms``: ``bits`` 1 = L0 (confirmed), 2 = L1;
``spec_deadline_ms`` (server clock, ``TIME``) > now means a speculative L0.

Writes are the ``APPLY`` script, ``kvindex/lua/apply.lua`` shipped as package data
(one round trip per event batch, read-modify-write of each value on the server);
``ApplyArgs`` names its arguments. Keys travel as ONE argument: the block key
names concatenated, all of the same length ``len`` (``{kvgate:<ns>}:b:`` + 16
hex digits). redis-py packs arguments in pure Python (~0.7 µs each), so 256
separate KEYS would cost more than the script. Every name carries the same hash
tag, so they all live in the slot of ``KEYS[1]`` (the first name), which is what
Redis Cluster routes on; open-source Redis (standalone and Cluster) lets a
legacy EVAL script touch undeclared keys of its own slot.

A group summary (``s:`` key) is ``<epoch>#<n>*<value>/<n>*<value>...``: the
values of the group's 16 blocks in chain order, run-length encoded (``value``
empty where nobody holds the block). ``APPLY`` rewrites it whenever one of its
blocks changes, with the group hashes described in ``RedisStore``'s docstring.

Reads are NOT a script: ``RedisStore`` sends ``TIME`` and ``MGET`` (all keys
declared, so any Cluster proxy accepts it) and walks the reply here, in
``prefix_walk``. Why: a Lua walk over 2048 keys spent ~0.55-0.8 ms of Redis time
turning names into Lua strings and back, and a script that only reads the
summaries still costs ~200 µs (its 32 KB argument alone ~45 µs: Redis hashes Lua
strings in full) against ~20 µs for the MGET. Redis is the shared resource; the
gateway replica, which scales out, does the walk with C-level list operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from itertools import accumulate, compress, islice
from operator import ne


def lua_script(name: str) -> str:
    """The text of ``kvindex/lua/<name>.lua``, read as package data (so an installed
    wheel works, not only a source checkout)."""
    return files("kvindex").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


APPLY = lua_script("apply")


@dataclass(frozen=True, slots=True)
class ApplyArgs:
    """One ``APPLY`` call's arguments by name; ``argv()`` is the order apply.lua reads.

    Positions (``kvindex.store.Positions``) are empty strings when unknown: then the
    call writes blocks but no group summaries."""

    op: str  # S0/S1/S2: stored in tier; R0/R1/R2: removed; P: speculate; C: clear
    pod_id: str  # the pod as stored in values (``RedisStore.pod_id``)
    key_ttl_ms: int  # TTL of the block keys a store writes
    names: bytes  # the keys' names concatenated (block names, or summaries for C)
    name_len: int  # bytes per name
    extra: int  # P: speculation TTL ms; C: tier mask (1 L0, 2 L1, 4 L2 written by pod)
    pod_name: str  # non-empty: (re)register pod_id -> pod_name in ``registry``
    registry: str  # the pod id -> name hash
    offsets: str  # one hex digit per key: its offset in its 16-block group
    anchors: str  # 16 hex digits per key: its group's first key
    parents: str  # 16 hex digits per key: the key before it on its chain
    root: str  # the namespace root ``{kvgate:<ns>}:``

    @property
    def first_name(self) -> bytes:
        """The one declared key: its hash slot is the slot of every name (one hash tag)."""
        return self.names[: self.name_len]

    def argv(self) -> tuple[str | int | bytes, ...]:
        return (
            self.op, self.pod_id, self.key_ttl_ms, self.names, self.name_len, self.extra,
            self.pod_name, self.registry, self.offsets, self.anchors, self.parents, self.root,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Walk:
    """A prefix walk over block values, in pod ids (``RedisStore`` names them)."""

    l2: int  # fleet-wide consecutive L2 prefix
    pods: dict[str, tuple[int, int]]  # pod id -> (L0 prefix, L0∪L1 prefix); holders of key 0
    writers: dict[str, int]  # L2 writer pod id -> blocks it wrote within the L2 prefix


# ``x`` of an entry: 2 tier bits + 4 * a deadline in ms fits in a u64 (20 digits)
_MAX_ENTRY_DIGITS = 20


def holders(value: bytes, now_ms: int) -> tuple[dict[str, int], str]:
    """Pod id -> live tier bits (1 L0, incl. unexpired speculation; 2 L1), and the L2 writer.

    What does not parse (a value not written by ``APPLY``: corrupt, or from another
    version) is skipped as absent: an entry whose number is not plain ASCII digits,
    and a value without the ``|`` after its writer. Never an exception: one bad key
    must not fail every lookup whose prefix reaches it until its TTL."""
    writer, bar, entries = value.decode(errors="replace").partition("|")
    if not bar:
        return {}, ""
    seen: dict[str, int] = {}
    for entry in entries.split(";"):
        pod, _, digits = entry.rpartition("=")
        if not (pod and _is_entry_number(digits)):
            continue
        x = int(digits)
        bits = x & 3
        if not bits & 1 and x >> 2 > now_ms:
            bits |= 1
        if bits:
            seen[pod] = bits
    return seen, writer


def _is_entry_number(digits: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes '²', which ``int`` rejects), and
    few enough for ``int`` (it refuses strings of more than 4300 digits)."""
    return 0 < len(digits) <= _MAX_ENTRY_DIGITS and digits.isascii() and digits.isdigit()


def prefix_walk(
    values: Sequence[bytes | None], now_ms: int, sizes: Sequence[int] | None = None
) -> Walk:
    """Consecutive prefixes over ``values`` (MGET order; None = key absent), exactly.

    ``sizes``: how many blocks each value stands for (a group summary stands for
    16); by default one each. Positions in the result count blocks.

    Consecutive blocks of one cached prompt nearly always hold the same bytes, so
    the walk visits *runs* of equal values: the run starts come from one C-level
    pass (``map(ne, …)``), and Python only decodes each distinct value once and
    updates the per-pod chains where the value changes. Cost: one pass in C per
    lookup plus a few µs per run. The walk stops at the first key nobody holds
    (absent, or only expired speculation and no L2 copy)."""
    n = len(values)
    if not n or values[0] is None:
        return Walk(0, {}, {})
    at = range(n + 1) if sizes is None else [0, *accumulate(sizes)]  # item -> first block
    starts = [0, *compress(range(1, n), map(ne, values, islice(values, 1, None))), n]
    decoded: dict[bytes, tuple[dict[str, int], str]] = {}
    alive0: set[str] = set()  # pods whose L0 chain is unbroken
    alive01: set[str] = set()  # pods whose L0∪L1 chain is unbroken
    ends0: dict[str, int] = {}
    ends01: dict[str, int] = {}
    writers: dict[str, int] = {}
    l2, end = -1, at[n]  # l2 < 0: the L2 chain is unbroken
    for r in range(len(starts) - 1):
        v = values[starts[r]]
        k = at[starts[r]]
        if v is None:
            end = k
            break
        got = decoded.get(v)
        if got is None:
            got = decoded[v] = holders(v, now_ms)
        seen, writer = got
        if k == 0:
            alive01 = set(seen)
            alive0 = {p for p, bits in seen.items() if bits & 1}
            ends0 = dict.fromkeys(seen, 0)  # L1-only holders of key 0: no L0 prefix
        else:
            for p in [p for p in alive0 if not seen.get(p, 0) & 1]:
                ends0[p] = k
                alive0.discard(p)
            for p in [p for p in alive01 if p not in seen]:
                ends01[p] = k
                alive01.discard(p)
        if l2 < 0:
            if writer:
                writers[writer] = writers.get(writer, 0) + at[starts[r + 1]] - k
            else:
                l2 = k
        if not alive01 and l2 >= 0:
            end = k  # nobody's chain can grow past here
            break
    ends0.update(dict.fromkeys(alive0, end))
    ends01.update(dict.fromkeys(alive01, end))
    return Walk(end if l2 < 0 else l2, {p: (ends0[p], ends01[p]) for p in ends01}, writers)
