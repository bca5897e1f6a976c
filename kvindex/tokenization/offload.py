"""Whether new text is encoded on the event loop or in a worker thread.

A thread hop is not free: on a 2-core VM it cost ~200 µs of CPU per hop (GIL hand-offs,
wake-ups; ``python -m bench.tokenize_spread`` and docs/performance.md, "Judged over
runs, and the thread hop a second worker paid"), and when every core runs a gateway
worker it buys no parallelism at all; it only keeps the loop free for other requests
while the text is encoded. So text is
encoded inline unless encoding it would hold the loop longer than ``budget_s``.

The cost of encoding depends on the text: ~0.2-0.25 µs a character for words the
word cache (``words.py``) has not seen, ~0.035 µs for text of known words. The estimate
is the text's characters times the encoder's recent cost per character, measured on
every encode (a decaying, character-weighted mean), so traffic of known words encodes
its new turns inline and novel text goes to a thread as before. Two bounds keep one
misjudged estimate harmless: text of at most ``min_chars`` is always inline (a hop
costs more than it saves), text over ``max_chars`` always goes to a thread (the most
the loop can be held is ``max_chars`` at the slowest cost, ~2 ms).
"""

from __future__ import annotations

DEFAULT_MIN_CHARS = 2048  # always inline: ~0.5 ms of encoding at the slowest cost
DEFAULT_MAX_CHARS = 8192  # always in a thread: ~2 ms at the slowest cost
DEFAULT_BUDGET_S = 0.0005  # what a request may hold the loop for when encoding inline
SLOWEST_S_PER_CHAR = 0.25e-6  # novel text, no word cache (2-core VM); the first estimate
_DECAY = 0.9  # each encode's weight against what came before
_PRIOR_CHARS = 4096.0  # the first estimate counts as this much text


class OffloadPolicy:
    """Decides inline or thread for ``chars`` of text to encode, from measured costs."""

    def __init__(
        self,
        min_chars: int = DEFAULT_MIN_CHARS,
        max_chars: int = DEFAULT_MAX_CHARS,
        budget_s: float = DEFAULT_BUDGET_S,
    ) -> None:
        self.min_chars = min_chars
        self.max_chars = max(max_chars, min_chars)
        self.budget_s = budget_s
        self._chars = _PRIOR_CHARS
        self._seconds = _PRIOR_CHARS * SLOWEST_S_PER_CHAR

    @property
    def s_per_char(self) -> float:
        """The recent cost of encoding one character (seconds)."""
        return self._seconds / self._chars

    def inline(self, chars: int) -> bool:
        if chars <= self.min_chars:
            return True
        if chars > self.max_chars:
            return False
        return chars * self.s_per_char <= self.budget_s

    def observe(self, chars: int, seconds: float) -> None:
        """One encode of ``chars`` characters took ``seconds`` of CPU."""
        if chars <= 0 or not seconds >= 0:
            return
        self._chars = self._chars * _DECAY + chars
        self._seconds = self._seconds * _DECAY + seconds
