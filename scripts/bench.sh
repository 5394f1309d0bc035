#!/usr/bin/env bash
# Builds Sandbar in release mode, starts a server on a free loopback port with its own data
# directory, waits for the built-in templates, runs sandbar-bench against it, and stops the server.
# Arguments are passed to sandbar-bench (see `target/release/sandbar-bench --help`).
# Must run as root. Environment:
#   SANDBAR_BENCH_DATA_DIR  data directory of the benchmark server (default /var/tmp/sandbar-bench)
#   SANDBAR_BENCH_READY_TIMEOUT  seconds to wait for the built-in templates (default 1800)
#   SANDBAR_BENCH_POOL_GB   size of the sandbox disk pool made on the first start (default 9,
#                           enough for 1,000 idle sandboxes; the server's own default takes
#                           half the free space, which a benchmark does not need)
#   SANDBAR_BENCH_MAX_SANDBOXES  the team's sandbox limit (default 1100, room for `--crowd 1000`)
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

if [[ $EUID -ne 0 ]]; then
  echo "bench.sh: must run as root (sandboxes and runc need it)" >&2
  exit 1
fi

data_dir="${SANDBAR_BENCH_DATA_DIR:-/var/tmp/sandbar-bench}"
ready_timeout="${SANDBAR_BENCH_READY_TIMEOUT:-1800}"
pool_gb="${SANDBAR_BENCH_POOL_GB:-9}"
max_sandboxes="${SANDBAR_BENCH_MAX_SANDBOXES:-1100}"
# Registered on the first start of a data directory only, so it never changes.
api_key="e2b_78b389cd3477e8e0738f8909e035846bc6bfc143"

./scripts/install-deps.sh --test
# The same build as the test suite's (every target at once), so one shares the other's artifacts.
cargo build --release --workspace --all-targets

port="$(free_port)"
url="http://127.0.0.1:$port"

log="$(mktemp -t sandbar-bench-server.XXXXXX.log)"
server_pid=""
stop_server() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -f "$log"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

mkdir -p "$data_dir"
# Room for the crowd: the first start's team gets it from --max-sandboxes, a team made by an
# earlier run from set-limits.
if [[ -f "$data_dir/sandbar.db" ]]; then
  for team in $(./target/release/sandbar team list --data-dir "$data_dir" | awk '{print $1}'); do
    ./target/release/sandbar team set-limits "$team" --max-sandboxes "$max_sandboxes" --data-dir "$data_dir" >/dev/null
  done
fi
SANDBAR_API_KEY="$api_key" RUST_LOG="${RUST_LOG:-warn}" \
  ./target/release/sandbar serve --listen "127.0.0.1:$port" --data-dir "$data_dir" \
  --max-sandboxes "$max_sandboxes" --disk-pool-gb "$pool_gb" >"$log" 2>&1 &
server_pid=$!

echo "bench.sh: server on $url (data in $data_dir), waiting for the built-in templates" >&2
deadline=$((SECONDS + ready_timeout))
while :; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "bench.sh: the server exited:" >&2
    cat "$log" >&2
    exit 1
  fi
  templates="$(curl -fsS -H "X-API-Key: $api_key" "$url/templates" 2>/dev/null || true)"
  # Every built-in template built, not only `base`: a build left running in the background
  # (the code interpreter's installs packages for minutes) would be measured with the creates.
  if grep -q '"buildStatus":"ready"' <<<"$templates" \
    && ! grep -Eq '"buildStatus":"(building|waiting)"' <<<"$templates"; then
    break
  fi
  if grep -q '"buildStatus":"error"' <<<"$templates"; then
    echo "bench.sh: the template failed to build: $templates" >&2
    cat "$log" >&2
    exit 1
  fi
  if ((SECONDS >= deadline)); then
    echo "bench.sh: the template was not ready after ${ready_timeout}s" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  sleep 1
done

status=0
./target/release/sandbar-bench --api-url "$url" --api-key "$api_key" --data-dir "$data_dir" "$@" \
  || status=$?
if ((status != 0)); then
  echo "bench.sh: sandbar-bench failed; server log:" >&2
  tail -n 40 "$log" >&2
fi
exit "$status"
