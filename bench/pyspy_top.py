"""Top entries of a py-spy raw profile (``py-spy record -f raw``): where the samples
are, by own time and inclusive, as docs/performance.md prints them.

    python -m bench.pyspy_top PROFILE [N]
"""

from __future__ import annotations

import re
import sys
from collections import Counter

_SITE = re.compile(r"\(/[^)]*site-packages/")


def top(path: str, n: int = 20) -> str:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            samples = int(count)
            total += samples
            frames = [_SITE.sub("(", frame) for frame in stack.split(";")]
            own[frames[-1]] += samples
            for frame in set(frames):
                inclusive[frame] += samples
    lines = [f"{total} samples", "own time:"]
    lines += [f"{100 * c / total:5.1f}%  {f}" for f, c in own.most_common(n)]
    lines.append("inclusive:")
    lines += [f"{100 * c / total:5.1f}%  {f}" for f, c in inclusive.most_common(n)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(top(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20))
