#!/usr/bin/env bash
# CPU time per request of two dlserve code trees, alternated: the server's and its worker's
# user + system time over 4 s of a perf_analyzer run on add_sub, divided by the requests the
# server answered meanwhile (its statistics). On this shared 2-vCPU machine throughput moves
# by 10-20% between runs of the same code; CPU time per request moves far less, so a change
# to how the server spends its CPU (polling, say) shows in it when throughput cannot tell.
#
#   git worktree add /tmp/old_tree <rev>
#   bash benchmarks/ab_cpu_per_request.sh /tmp/old_tree [http|grpc] [ROUNDS] ["1 4 16"]
#
# "old" runs the server with PYTHONPATH=OLD_TREE (the editable install yields to it),
# "new" the working tree. Needs the reference servers' perf_analyzer ($REF/setup.sh).
set -euo pipefail
OLD=${1:?usage: ab_cpu_per_request.sh OLD_TREE [http|grpc] [ROUNDS] [CONCURRENCIES]}
PROTO=${2:-http}
ROUNDS=${3:-3}
CONCURRENCIES=${4:-"1 4 16"}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REF=${REF:-$ROOT/../shared/tools/reference-servers}
WORK=$(mktemp -d)
server=""
stop_server() { if [ -n "$server" ]; then kill -INT "$server" 2>/dev/null && wait "$server" || true; server=""; fi; }
trap 'stop_server; rm -rf "$WORK"' EXIT
mkdir "$WORK/repo" && cp -r "$REF/models/add_sub" "$WORK/repo/"
cd "$WORK"  # outside the checkout: its triton_python_backend_utils shim stays out of the way

free_port() { "$ROOT/.venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cpu_ticks() { local total=0 fields; for pid in "$@"; do read -r -a fields < <(cut -d' ' -f14,15 "/proc/$pid/stat"); total=$((total + fields[0] + fields[1])); done; echo "$total"; }
answered() { curl -s "127.0.0.1:$HTTP/v2/models/add_sub/stats" | "$ROOT/.venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["model_stats"][0]["inference_count"])'; }

for round in $(seq "$ROUNDS"); do
  for tree in old new; do
    HTTP=$(free_port); GRPC=$(free_port); METRICS=$(free_port)
    if [ "$tree" = old ]; then export PYTHONPATH=$OLD; fi
    "$ROOT/.venv/bin/dlserve" serve --model-repository repo --http-address 127.0.0.1 --http-port "$HTTP" \
      --grpc-address 127.0.0.1 --grpc-port "$GRPC" --metrics-address 127.0.0.1 --metrics-port "$METRICS" \
      > "serve_$tree.log" 2>&1 &
    server=$!
    unset PYTHONPATH
    for _ in $(seq 100); do curl -sf "127.0.0.1:$HTTP/v2/health/ready" > /dev/null && break; sleep 0.2; done
    worker=$(pgrep -P "$server" | head -1)
    port=$HTTP; [ "$PROTO" = grpc ] && port=$GRPC
    line="round $round $tree:"
    for c in $CONCURRENCIES; do
      bash "$REF/pa.sh" -m add_sub -i "$PROTO" --concurrency-range "$c" -u "127.0.0.1:$port" \
        --measurement-interval 6000 --stability-percentage 1000 --max-trials 1 > pa.log 2>&1 &
      loadgen=$!
      sleep 2
      ticks0=$(cpu_ticks "$server" "$worker"); n0=$(answered); t0=$(date +%s.%N)
      sleep 4
      ticks1=$(cpu_ticks "$server" "$worker"); n1=$(answered); t1=$(date +%s.%N)
      wait "$loadgen" || true  # (no stable measurement: an exit code, the run is what counts)
      hz=$(getconf CLK_TCK)
      line="$line c$c $("$ROOT/.venv/bin/python" -c "print(f'{($ticks1 - $ticks0) / $hz * 1e6 / ($n1 - $n0):.0f} us/request at {($n1 - $n0) / ($t1 - $t0):.0f}/s')")"
    done
    echo "$line"
    stop_server
  done
done
