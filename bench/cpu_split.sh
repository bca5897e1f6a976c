#!/usr/bin/env bash
# Where the CPU of a loaded gateway goes, per request: the gateway (all its worker
# processes), the zero-latency backend and wrk, during an 8 s wrk run with 32
# connections and the overhead benchmark's ~8 KB chats. With N workers on a machine
# of N cores, req/s can reach at most cores / (gateway + backend + wrk) ms.
#
#   bench/cpu_split.sh [varied|multi-turn]
#   WORKERS=2 STRATEGY=kv-aware TREE=/tmp/old bench/cpu_split.sh multi-turn  # another checkout
set -euo pipefail
workload=${1:-varied}
cd "$(dirname "$0")/.."
source bench/gateway_load.sh
py=$(pwd)/${PYTHON:-.venv/bin/python}
setup_gateway_env
start_zero_pod
start_gateway "${TREE:-.}" "$gw_port" "$admin_port" "${WORKERS:-1}" "${STRATEGY:-kv-aware}"
trap 'kill $gw 2>/dev/null; sleep 0.5; kill $pod 2>/dev/null; rm -f "$lua" "$lua.time"' EXIT
wrk_lua "$workload" > "$lua"
wait_ready "$gw_port"
url="http://127.0.0.1:$gw_port/v1/chat/completions"
wrk -t2 -c32 -d3s -s "$lua" "$url" > /dev/null  # warm-up
gw_pids() { echo "$gw" $(pgrep -P "$gw" || true); }
g0=$(cpu_ticks $(gw_pids)); p0=$(cpu_ticks "$pod")
out=$(/usr/bin/time -f "%U %S" -o "$lua.time" wrk -t2 -c32 -d8s -s "$lua" "$url")
g1=$(cpu_ticks $(gw_pids)); p1=$(cpu_ticks "$pod")
"$py" -c "
rps = float('$(echo "$out" | awk '/Requests\/sec/ {print $2}')')
reqs = int('$(echo "$out" | awk '/requests in/ {print $1}')')
hz = $(getconf CLK_TCK)
wrk_s = sum(map(float, '$(cat "$lua.time")'.split()))
ms = lambda s: 1000 * s / reqs
print(f'workers=${WORKERS:-1} ${STRATEGY:-kv-aware} $workload req/s={rps:.0f} CPU ms/req: '
      f'gateway {ms(($g1 - $g0) / hz):.3f} backend {ms(($p1 - $p0) / hz):.3f} wrk {ms(wrk_s):.3f}')"
