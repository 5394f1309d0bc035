#!/usr/bin/env bash
# Compares the node's launch steps of several builds, alternating them round by round on one
# host. Each build runs as its own server with its own data directory; the script creates and
# deletes N sandboxes through the API and prints the medians of the node's
# "sandbox launch timings" debug lines (all but the first three creates of each run), and of
# the time the network namespace pool took to prepare each namespace, where the build logs it.
#
# usage: scripts/bench-launch.sh ROUNDS N LABEL=BIN_DIR:DATA_DIR[:SERVER_ARGS] [...]
#   BIN_DIR holds `sandbar` and `sandbar-agent` of one build; SERVER_ARGS are extra arguments
#   of `sandbar serve`, split at spaces (e.g. `--sandbox-bandwidth-mbit 0`). Must run as root,
#   with no other Sandbar server on the host (the firewall table is shared).
set -euo pipefail
rounds=$1
creates=$2
shift 2
key=e2b_0123456789abcdef0123456789abcdef01234567
port=${SANDBAR_BENCH_PORT:-3996}
for round in $(seq "$rounds"); do
  for build in "$@"; do
    label=${build%%=*}
    dirs=${build#*=}
    bin=${dirs%%:*}
    rest=${dirs#*:}
    data=${rest%%:*}
    extra=()
    if [[ $rest == *:* ]]; then
      read -r -a extra <<< "${rest#*:}"
    fi
    log=$(mktemp -t "bench-launch-$label.XXXXXX.log")
    SANDBAR_API_KEY=$key RUST_LOG=sandbar_node=debug,info "$bin/sandbar" serve \
      --listen "127.0.0.1:$port" --data-dir "$data" "${extra[@]}" > "$log" 2>&1 &
    server=$!
    for _ in $(seq 1200); do
      curl -sf -H "X-API-Key: $key" "http://127.0.0.1:$port/templates" | grep -q ready && break
      sleep 0.5
    done
    sleep 2
    for _ in $(seq "$creates"); do
      id=$(curl -sf -X POST -H "X-API-Key: $key" -H 'content-type: application/json' \
        -d '{"templateID":"base","timeout":60}' "http://127.0.0.1:$port/v2/sandboxes" |
        python3 -c "import sys,json;print(json.load(sys.stdin)['sandboxID'])")
      curl -sf -X DELETE -H "X-API-Key: $key" "http://127.0.0.1:$port/sandboxes/$id"
      sleep 0.2
    done
    kill "$server"
    wait "$server" || true
    printf '%s round %s (load %s): ' "$label" "$round" "$(cut -d' ' -f1 /proc/loadavg)"
    grep "launch timings" "$log" | sed 's/\x1b\[[0-9;]*m//g' | python3 -c '
import re, statistics, sys
rows = [dict((k, int(v)) for k, v in re.findall(r"(\w+_us)=(\d+)", line)) for line in sys.stdin][3:]
print(len(rows), "creates,", " ".join(f"{k}={statistics.median(r[k] for r in rows):.0f}" for k in rows[0]))
'
    grep "network namespace prepared" "$log" | sed 's/\x1b\[[0-9;]*m//g' | python3 -c '
import re, statistics, sys
us = [int(m.group(1)) for m in map(re.compile(r"prepare_us=(\d+)").search, sys.stdin) if m]
if us:
    print(f"    {len(us)} namespaces prepared, prepare_us p50={statistics.median(us):.0f}",
          f"p90={sorted(us)[int(len(us) * 0.9)]}")
'
    rm -f "$log"
  done
done
