# Sourced by bench/profile_gateway.sh, ab_gateway.sh, cpu_split.sh, gc_pauses.sh,
# duel_gateway.sh and workers_vs_processes.sh: what they do around a gateway under wrk
# load. Needs $py (the project's python).

# Three free loopback ports ($pod_port $gw_port $admin_port), KVGATE_MODELS exported for
# the tiny test model's tokenizer, and a temporary file for wrk's Lua script ($lua).
setup_gateway_env() {
  read -r pod_port gw_port admin_port < <("$py" -c "
from bench.ports import free_ports; print(*free_ports(3))")
  local tokenizer
  tokenizer=$("$py" -c "from bench.tinymodel import ensure_tokenizer; print(ensure_tokenizer())")
  export KVGATE_MODELS="{\"kvgate-tiny-llama\": {\"block_size\": 32, \"tokenizer\": \"$tokenizer\"}}"
  lua=$(mktemp --suffix=.lua)
}

# User + system CPU of the given pids so far, in clock ticks (getconf CLK_TCK a second).
cpu_ticks() {
  local total=0 t
  for p in "$@"; do
    t=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
    total=$((total + t))
  done
  echo "$total"
}

# The zero-latency backend on $pod_port in the background, its pid in $pod; PIN: the
# cores to pin it to (taskset; empty: not pinned).
start_zero_pod() {
  local pin=${1:-}
  ${pin:+taskset -c "$pin"} "$py" -m bench.zero_pod --port "$pod_port" &
  pod=$!
}

# `kvgate serve` from checkout TREE (its code, $py's packages) on PORT and ADMIN_PORT in
# front of the zero pod, in the background, its pid in $gw; PIN as for start_zero_pod.
# Needs $py as an absolute path.
start_gateway() {
  local tree=$1 port=$2 admin=$3 workers=$4 strategy=$5 pin=${6:-}
  (cd "$tree" && exec ${pin:+taskset -c "$pin"} "$py" -m cli serve --port "$port" \
    --admin-port "$admin" --workers "$workers" --pod "zero=http://127.0.0.1:$pod_port" \
    --strategy "$strategy" --log-level warning) &
  gw=$!
}

# The overhead benchmark's ~8 KB chat bodies as a wrk Lua script, for WORKLOAD
# (varied | multi-turn), on stdout.
wrk_lua() {
  "$py" -c "from bench.overhead import Bodies, wrk_script
print(wrk_script('$1', Bodies(8192).base))"
}

# Wait (30 s at most) until the gateway on loopback PORT answers /ready with 200.
wait_ready() {
  "$py" -c "
import httpx
from bench.polling import wait_for
def ready():
    try:
        return httpx.get('http://127.0.0.1:$1/ready').status_code == 200
    except httpx.HTTPError:
        return False
wait_for(ready, 30, 'the gateway ready')"
}
