"""A small, independent reader of vLLM's ZMQ KV-event stream for the e2e tests.

Deliberately separate from ``kvindex.events``: these tests pin down what vLLM
actually sends, so the oracle must not share code with the decoder under test.
It decodes with plain msgspec and knows only the vLLM >= 0.24 map shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

END_SEQ = b"\xff" * 8  # replay's end-of-sequence marker
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class Frame:
    """One published batch, raw and decoded."""

    topic: bytes
    seq_bytes: bytes
    payload: bytes

    @property
    def seq(self) -> int:
        return int.from_bytes(self.seq_bytes, "big")

    def batch(self) -> list[Any]:
        """``[ts, events, dp_rank]`` exactly as msgpack decodes it."""
        return _decoder.decode(self.payload)


@dataclass(frozen=True)
class StoredBlock:
    """One block of a ``BlockStored`` event, with its place in the chain."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    extra_keys: Any


def subscribe(ctx: zmq.Context, endpoint: str, settle_s: float = 0.5) -> zmq.Socket:
    """Connect a SUB socket to every topic; wait out ZMQ's slow-joiner window."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    time.sleep(settle_s)
    return sock


def drain(sock: zmq.Socket, quiet_s: float = 1.0, timeout_s: float = 15.0) -> list[Frame]:
    """Receive frames until none arrived for ``quiet_s`` (or ``timeout_s`` passed)."""
    frames: list[Frame] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sock.poll(int(quiet_s * 1000)):
        parts = sock.recv_multipart()
        if len(parts) != 3:
            raise AssertionError(f"expected 3 frames, got {len(parts)}")
        frames.append(Frame(*parts))
    return frames


def replay(ctx: zmq.Context, endpoint: str, start_seq: int, timeout_s: float = 5.0) -> list[Frame]:
    """Ask the ROUTER replay socket for every buffered batch from ``start_seq`` on.

    Request ``[b"", seq 8B BE]``; replies ``[b"", topic, seq, payload]`` and a final
    ``[b"", b"", 0xFF*8, b""]``. Raises if the end marker does not come in time.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        frames: list[Frame] = []
        while sock.poll(int(timeout_s * 1000)):
            parts = sock.recv_multipart()
            if len(parts) != 4 or parts[0] != b"":
                raise AssertionError(f"unexpected replay reply shape {[len(p) for p in parts]}")
            if parts[2] == END_SEQ:
                if parts[1] != b"" or parts[3] != b"":
                    raise AssertionError("end marker should carry empty topic and payload")
                return frames
            frames.append(Frame(parts[1], parts[2], parts[3]))
        raise TimeoutError(f"no replay end marker within {timeout_s}s")
    finally:
        sock.close()


def events(frames: list[Frame]) -> list[dict[str, Any]]:
    """All events of all frames, in publication order."""
    return [e for f in frames for e in f.batch()[1]]


def stored_blocks(frames: list[Frame]) -> list[StoredBlock]:
    """Split every ``BlockStored`` into per-block records (hash, parent, tokens)."""
    blocks: list[StoredBlock] = []
    for ev in events(frames):
        if ev.get("type") != "BlockStored":
            continue
        size = ev["block_size"]
        extra = ev.get("extra_keys") or [None] * len(ev["block_hashes"])
        parent = ev["parent_block_hash"]
        for i, h in enumerate(ev["block_hashes"]):
            tokens = tuple(ev["token_ids"][i * size : (i + 1) * size])
            blocks.append(StoredBlock(h, parent, tokens, extra[i]))
            parent = h
    return blocks


def chain_from_root(blocks: list[StoredBlock], first_tokens: list[int]) -> list[StoredBlock]:
    """Follow parent links from the root block whose tokens are ``first_tokens``.

    Tests prefix each prompt with a fresh nonce, so exactly one root matches and
    each block has at most one child among this request's blocks.
    """
    roots = [b for b in blocks if b.parent_hash is None and list(b.token_ids) == list(first_tokens)]
    if len(roots) != 1:
        raise AssertionError(f"expected one root block for the prompt, found {len(roots)}")
    child = {b.parent_hash: b for b in blocks if b.parent_hash is not None}
    chain = [roots[0]]
    while chain[-1].block_hash in child:
        chain.append(child[chain[-1].block_hash])
    return chain
