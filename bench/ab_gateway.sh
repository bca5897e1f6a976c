#!/usr/bin/env bash
# One gateway's throughput and CPU per request when its CPU is the limit: `kvgate serve`
# (from TREE, e.g. a worktree of an older commit) pinned to core 0, the zero-latency
# backend and wrk (1 thread, 32 connections) pinned to core 1, the overhead
# benchmark's bodies. Run it alternately for two trees to compare them in one sitting.
#
#   bench/ab_gateway.sh TREE STRATEGY [varied|multi-turn] [SECONDS]
#   git worktree add /tmp/old 8de3b1c && bench/ab_gateway.sh /tmp/old kv-aware multi-turn 10
#
# Prints req/s, the gateway's CPU ms per request and its CPU use (1.00: one full core).
set -euo pipefail
tree=$(cd "${1:?tree}" && pwd)
strategy=${2:?strategy}
workload=${3:-multi-turn}
secs=${4:-10}
cd "$(dirname "$0")/.."
source bench/gateway_load.sh
py=$(pwd)/${PYTHON:-.venv/bin/python}
setup_gateway_env
start_zero_pod 1
start_gateway "$tree" "$gw_port" "$admin_port" 1 "$strategy" 0
trap 'kill $gw $pod 2>/dev/null; rm -f "$lua"' EXIT
wrk_lua "$workload" > "$lua"
wait_ready "$gw_port"
url="http://127.0.0.1:$gw_port/v1/chat/completions"
taskset -c 1 wrk -t1 -c32 -d2s -s "$lua" "$url" > /dev/null  # warm-up
before=$(cpu_ticks "$gw")
out=$(taskset -c 1 wrk -t1 -c32 -d"${secs}s" -s "$lua" "$url")
after=$(cpu_ticks "$gw")
hz=$(getconf CLK_TCK)
"$py" -c "
rps = float('$(echo "$out" | awk '/Requests\/sec/ {print $2}')')
reqs = int('$(echo "$out" | awk '/requests in/ {print $1}')')
cpu_s = ($after - $before) / $hz
print(f'$tree $strategy $workload req/s={rps:.0f} cpu_ms/req={1000 * cpu_s / reqs:.3f} '
      f'cpu_use={cpu_s / $secs:.2f}')"
