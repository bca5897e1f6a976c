"""ZMQ framing of vLLM's KV-event stream (live PUB frames and replay replies).

Live:   ``[topic, seq (8 bytes, big-endian), payload]``
Replay: DEALER sends ``[b"", start_seq (8 bytes BE)]``; each reply is
        ``[b"", topic, seq, payload]`` (vLLM >= 0.26) or ``[b"", seq, payload]``
        (earlier), and the stream ends with seq ``0xFFFFFFFFFFFFFFFF`` and an empty
        payload. Parsers return ``None`` for anything else; callers count and skip.
"""

from __future__ import annotations

from dataclasses import dataclass

END_SEQ = 0xFFFFFFFFFFFFFFFF
SEQ_BYTES = 8


@dataclass(frozen=True, slots=True)
class Frame:
    seq: int
    payload: bytes
    topic: bytes = b""


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def _seq(raw: bytes) -> int | None:
    if len(raw) != SEQ_BYTES:
        return None
    return int.from_bytes(raw, "big")


def parse_live(frames: list[bytes]) -> Frame | None:
    """A PUB message, or None when it is not ``[topic, seq, payload]``."""
    if len(frames) != 3:
        return None
    seq = _seq(frames[1])
    if seq is None or seq == END_SEQ:
        return None
    return Frame(seq=seq, payload=frames[2], topic=frames[0])


def replay_request(start_seq: int) -> list[bytes]:
    """The DEALER message asking a ROUTER to resend every kept batch from ``start_seq``."""
    return [b"", encode_seq(start_seq)]


def parse_replay(frames: list[bytes]) -> Frame | None:
    """One replay reply; ``Frame.seq == END_SEQ`` marks the end of the stream.

    Accepts both reply shapes; the leading empty delimiter frame is optional because
    a DEALER sees it but a REQ socket strips it.
    """
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        topic, raw_seq, payload = frames
    elif len(frames) == 2:
        topic, (raw_seq, payload) = b"", frames
    else:
        return None
    seq = _seq(raw_seq)
    if seq is None:
        return None
    if seq == END_SEQ:
        return Frame(seq=END_SEQ, payload=b"", topic=topic)
    return Frame(seq=seq, payload=payload, topic=topic)
