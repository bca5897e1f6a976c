#!/usr/bin/env bash
# Profile a gateway under load: a zero-latency pod, `kvgate serve` in front of it,
# wrk with 32 connections sending ~8 KB chats (the overhead benchmark's bodies), and
# py-spy sampling the gateway (200 Hz for 8 s unless RATE and SECONDS_SAMPLED say
# otherwise). Prints wrk's requests/s and the profile's top entries (bench/pyspy_top.py).
#
#   bench/profile_gateway.sh STRATEGY [varied|multi-turn] [OUT.txt]
#   KVGATE_TREE=../kvgate-3da02ca bench/profile_gateway.sh ...   # an older checkout's gateway
#   WORKERS=2 bench/profile_gateway.sh ...   # `--workers 2`: both workers sampled together
#   SECONDS_SAMPLED=15 RATE=400 bench/profile_gateway.sh ...   # a longer, denser sample
#   SEQUENTIAL=1 bench/profile_gateway.sh ...   # one request at a time, as the overhead
#       benchmark's added-latency pairs send them (each pair: the backend, then the gateway)
#
# Needs wrk and py-spy (`make test` installs both: wrk from Debian, py-spy with the
# bench extra).
set -euo pipefail
strategy=${1:?strategy}
workload=${2:-varied}
out=${3:-/tmp/kvgate-profile-$strategy-$workload.txt}
cd "$(dirname "$0")/.."
source bench/gateway_load.sh
py=${PYTHON:-.venv/bin/python}
spy=$(command -v py-spy || echo .venv/bin/py-spy)
setup_gateway_env
"$py" -m bench.zero_pod --port "$pod_port" &
pod=$!
if [[ -n "${KVGATE_TREE:-}" ]]; then
  # A "before" profile: the gateway of another checkout (a worktree of an older
  # commit, from before `cli/`, the admin listener and --workers).
  (cd "$KVGATE_TREE" && exec "$OLDPWD/$py" -m gateway.cli serve --port "$gw_port" \
    --pod "zero=http://127.0.0.1:$pod_port" --strategy "$strategy" --log-level warning) &
else
  "$py" -m cli serve --port "$gw_port" --admin-port "$admin_port" --workers "${WORKERS:-1}" \
    --pod "zero=http://127.0.0.1:$pod_port" --strategy "$strategy" --log-level warning &
fi
gw=$!
trap 'kill $gw $pod 2>/dev/null; rm -f "$lua"' EXIT
wrk_lua "$workload" > "$lua"
wait_ready "$gw_port"
if [[ -n "${SEQUENTIAL:-}" ]]; then
  "$py" - "$pod_port" "$gw_port" "$workload" "${SECONDS_SAMPLED:-8}" > "$out.wrk" <<'PY' &
import asyncio, sys, time
from bench.overhead import Bodies, paired
from bench.stats import percentile
pod, gw, workload, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
bodies, diffs, end = Bodies(8192, seed=5), [], time.monotonic() + seconds + 2
while time.monotonic() < end:
    diffs += asyncio.run(paired(f"http://127.0.0.1:{pod}", f"http://127.0.0.1:{gw}", bodies,
                                workload, 100, stream=False))
print(f"sequential pairs: {len(diffs)}, added p50 {percentile(diffs, 50):.2f} ms")
PY
else
  wrk -t2 -c32 -d$(( ${SECONDS_SAMPLED:-8} + 4 ))s -s "$lua" "http://127.0.0.1:$gw_port/v1/chat/completions" > "$out.wrk" &
fi
sleep 1
"$spy" record -p "$gw" -d ${SECONDS_SAMPLED:-8} -r ${RATE:-200} -f raw -o "$out" --nonblocking \
  $([[ "${WORKERS:-1}" != 1 ]] && echo --subprocesses) > /dev/null 2>&1
wait %3 2>/dev/null || sleep 4
grep -E "Requests/sec|Non-2xx|sequential pairs" "$out.wrk" || true
"$py" -m bench.pyspy_top "$out"
