#!/usr/bin/env bash
# Two gateways at once, to compare two trees on a machine whose speed drifts: `kvgate
# serve` from TREE_A and from TREE_B both pinned to core 0, each under its own wrk (1
# thread, 32 connections, the overhead benchmark's bodies) pinned to core 1 with the
# zero-latency backend. The scheduler splits core 0 fairly between two busy processes,
# so the ratio of their req/s is the inverse ratio of their CPU per request, and a
# slowdown of the machine during the run slows both alike (bench/ab_gateway.sh runs
# one tree at a time: a ratio across its runs carries the drift between them). Run it
# again with the trees swapped: which one started first, or got which port, must not
# decide.
#
#   bench/duel_gateway.sh TREE_A TREE_B [varied|multi-turn] [SECONDS]
#   git worktree add /tmp/old HEAD~1 && bench/duel_gateway.sh /tmp/old . varied 20
#
# Prints each tree's req/s and B/A (above 1: B spends less CPU a request).
set -euo pipefail
tree_a=$(cd "${1:?tree A}" && pwd)
tree_b=$(cd "${2:?tree B}" && pwd)
workload=${3:-varied}
secs=${4:-20}
strategy=${STRATEGY:-kv-aware}
cd "$(dirname "$0")/.."
source bench/gateway_load.sh
py=$(pwd)/${PYTHON:-.venv/bin/python}
setup_gateway_env  # $pod_port, and $gw_port $admin_port for tree A
read -r gw_b admin_b < <("$py" -c "from bench.ports import free_ports; print(*free_ports(2))")
out_a=$(mktemp) out_b=$(mktemp)
start_zero_pod 1
start_gateway "$tree_a" "$gw_port" "$admin_port" 1 "$strategy" 0
gw_a=$gw
start_gateway "$tree_b" "$gw_b" "$admin_b" 1 "$strategy" 0
gw_b_pid=$gw
trap 'kill $gw_a $gw_b_pid $pod 2>/dev/null; rm -f "$lua" "$out_a" "$out_b"' EXIT
wrk_lua "$workload" > "$lua"
wait_ready "$gw_port"
wait_ready "$gw_b"
taskset -c 1 wrk -t1 -c32 -d"${secs}s" -s "$lua" "http://127.0.0.1:$gw_port/v1/chat/completions" > "$out_a" &
load_a=$!
taskset -c 1 wrk -t1 -c32 -d"${secs}s" -s "$lua" "http://127.0.0.1:$gw_b/v1/chat/completions" > "$out_b"
wait "$load_a"
rps() { awk '/Requests\/sec/ {print $2}' "$1"; }
"$py" -c "
a, b = $(rps "$out_a"), $(rps "$out_b")
print(f'A {a:,.0f} req/s ($tree_a)  B {b:,.0f} req/s ($tree_b)  B/A {b / a:.3f}')"
