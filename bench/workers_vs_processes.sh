#!/usr/bin/env bash
# What acting as one router costs `--workers 2`: in turn, one worker, `--workers 2` and
# two independent single-worker gateways (nothing shared: two ports, a wrk each), all in
# front of one zero-latency pod, kv-aware on the overhead benchmark's varied ~8 KB
# chats; each run 3 s of warm-up and 8 s measured. Prints each round's req/s and the
# ratios to one worker (docs/performance.md, "What acting as one router costs two
# workers").
#
#   bench/workers_vs_processes.sh            # three rounds
#   ROUNDS=5 STRATEGY=prefix-aware bench/workers_vs_processes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gateway_load.sh
py=$(pwd)/${PYTHON:-.venv/bin/python}
strategy=${STRATEGY:-kv-aware}
setup_gateway_env
start_zero_pod > /dev/null 2>&1
read -r port2 admin2 < <("$py" -c "from bench.ports import free_ports; print(*free_ports(2))")
trap 'kill $pod 2>/dev/null; rm -f "$lua" "$lua".*.txt' EXIT
wrk_lua varied > "$lua"
path=/v1/chat/completions

rps() { awk '/Requests\/sec/ {s += $2} END {printf "%.0f", s}' "$@"; }

one_gateway() {  # WORKERS: req/s of one gateway with that many workers
  start_gateway . "$gw_port" "$admin_port" "$1" "$strategy" > /dev/null 2>&1
  wait_ready "$gw_port" 2> /dev/null
  wrk -t2 -c32 -d3s -s "$lua" "http://127.0.0.1:$gw_port$path" > /dev/null
  wrk -t2 -c32 -d8s -s "$lua" "http://127.0.0.1:$gw_port$path" > "$lua.a.txt"
  kill $gw; sleep 1.5
  rps "$lua.a.txt"
}

two_processes() {  # req/s of two single-worker gateways, a wrk of 16 connections each
  start_gateway . "$gw_port" "$admin_port" 1 "$strategy" > /dev/null 2>&1; local g1=$gw
  start_gateway . "$port2" "$admin2" 1 "$strategy" > /dev/null 2>&1; local g2=$gw
  wait_ready "$gw_port" 2> /dev/null; wait_ready "$port2" 2> /dev/null
  for seconds in 3 8; do
    wrk -t1 -c16 -d${seconds}s -s "$lua" "http://127.0.0.1:$gw_port$path" > "$lua.a.txt" &
    local w=$!
    wrk -t1 -c16 -d${seconds}s -s "$lua" "http://127.0.0.1:$port2$path" > "$lua.b.txt"
    wait $w
  done
  kill $g1 $g2; sleep 1.5
  rps "$lua.a.txt" "$lua.b.txt"
}

for round in $(seq "${ROUNDS:-3}"); do
  one=$(one_gateway 1)
  two=$(one_gateway 2)
  procs=$(two_processes)
  "$py" -c "print(f'round $round $strategy: one worker $one req/s, --workers 2 $two '
      f'({$two / $one:.2f}x), two independent processes $procs ({$procs / $one:.2f}x)')"
done
