#!/usr/bin/env bash
# What the cyclic garbage collector costs a loaded gateway: `kvgate serve` (from TREE,
# e.g. a worktree of an older commit) in front of the zero-latency backend, wrk with 32
# connections sending the overhead benchmark's ~8 KB chats for SECONDS, then the
# gateway's own `kvgate_gc_pause_seconds` by generation: collections, total pause, and
# the mean and longest bucket of each.
#
#   bench/gc_pauses.sh [varied|multi-turn] [SECONDS]
#   STRATEGY=prefix-aware TREE=/tmp/old bench/gc_pauses.sh varied 30
set -euo pipefail
workload=${1:-varied}
secs=${2:-30}
cd "$(dirname "$0")/.."
source bench/gateway_load.sh
py=$(pwd)/${PYTHON:-.venv/bin/python}
setup_gateway_env
start_zero_pod
start_gateway "${TREE:-.}" "$gw_port" "$admin_port" 1 "${STRATEGY:-kv-aware}"
trap 'kill $gw $pod 2>/dev/null; rm -f "$lua"' EXIT
wrk_lua "$workload" > "$lua"
wait_ready "$gw_port"
url="http://127.0.0.1:$gw_port/v1/chat/completions"
sleep 1.5  # start-up's own collection reaches the histogram, and is left out:
before=$(curl -s "http://127.0.0.1:$admin_port/metrics")
wrk -t2 -c32 -d"${secs}s" -s "$lua" "$url" | grep -E "Requests/sec|Non-2xx" || true
sleep 1.5  # the pauses reach the histogram once a second
"$py" - "$secs" "$before" "$(curl -s "http://127.0.0.1:$admin_port/metrics")" <<'PY'
import sys

from prometheus_client.parser import text_string_to_metric_families


def pauses(text: str) -> dict[tuple[str, str, str], float]:
    """(generation, sample kind, bucket bound) -> value of kvgate_gc_pause_seconds."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvgate_gc_pause_seconds":
            for s in family.samples:
                kind = s.name.rsplit("_", 1)[-1]
                out[s.labels["generation"], kind, s.labels.get("le", "")] = s.value
    return out


seconds = float(sys.argv[1])
before, after = pauses(sys.argv[2]), pauses(sys.argv[3])
delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
for gen in sorted({k[0] for k in delta}):
    n, total = delta[gen, "count", ""], delta[gen, "sum", ""]
    bounds = sorted((float(le), v) for (g, kind, le), v in delta.items() if g == gen and kind == "bucket")
    longest = next((le for le, v in bounds if v >= n), float("nan")) if n else float("nan")
    mean = f"{1000 * total / n:.2f} ms" if n else "-"
    print(f"generation {gen}: {n:.0f} collections, {1000 * total:.0f} ms in all "
          f"({100 * total / seconds:.1f}% of {seconds:g} s), mean {mean}, "
          f"longest <= {1000 * longest:g} ms")
PY
