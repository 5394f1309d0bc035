#!/usr/bin/env bash
# What HTTPS costs: starts `sandbar serve --role api` (the API and edge, no sandboxes, so it
# needs neither root's host lock nor a template) with --listen and --tls-listen on free
# loopback ports, its certificate from `sandbar cert`, on a throwaway PostgreSQL cluster on a
# Unix socket; runs `sandbar-bench tls` against both listeners; stops and removes everything.
# Arguments are passed to `sandbar-bench tls` (see `sandbar-bench tls --help`).
# Build first: cargo build --release -p sandbar -p sandbar-bench
# Environment:
#   SANDBAR_BIN_DIR  where `sandbar` and `sandbar-bench` are (default target/release)
#   SANDBAR_PG_BIN   PostgreSQL's binaries (default /usr/lib/postgresql/15/bin)
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

bin_dir="${SANDBAR_BIN_DIR:-target/release}"
pg_bin="${SANDBAR_PG_BIN:-/usr/lib/postgresql/15/bin}"
for program in "$bin_dir/sandbar" "$bin_dir/sandbar-bench" "$pg_bin/initdb" "$pg_bin/pg_ctl"; do
  if [[ ! -x "$program" ]]; then
    echo "bench-tls.sh: $program is missing" >&2
    exit 1
  fi
done

work="$(mktemp -d -t sandbar-bench-tls.XXXXXX)"
chmod 0755 "$work"
# initdb and pg_ctl refuse root.
as_pg=()
if [[ $EUID -eq 0 ]]; then
  as_pg=(runuser -u postgres --)
  mkdir "$work/pg"
  chown postgres "$work/pg"
else
  mkdir "$work/pg"
fi
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$work/pg/data" stop -m immediate >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"${as_pg[@]}" "$pg_bin/initdb" -D "$work/pg/data" -U postgres -A trust --no-sync -E UTF8 \
  --no-locale >/dev/null
"${as_pg[@]}" "$pg_bin/pg_ctl" -D "$work/pg/data" -l "$work/pg/log" -w -t 60 \
  -o "-c listen_addresses='' -k $work/pg -c fsync=off" start >/dev/null

"$bin_dir/sandbar" cert --domain sandbar.localhost --out "$work/tls" >/dev/null
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/secret"
chmod 0600 "$work/secret"
mkdir -m 0700 "$work/data"

plain=$(free_port)
https=$(free_port)
RUST_LOG=warn "$bin_dir/sandbar" serve --role api \
  --database-url "postgres://postgres@localhost/postgres?host=$work/pg" \
  --cluster-secret-file "$work/secret" --data-dir "$work/data" \
  --listen "127.0.0.1:$plain" --tls-listen "127.0.0.1:$https" \
  --tls-cert "$work/tls/cert.pem" --tls-key "$work/tls/key.pem" \
  >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 100); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$https") 2>/dev/null; then
    break
  fi
  if ! kill -0 "$server_pid" 2>/dev/null; then
    cat "$work/server.log" >&2
    exit 1
  fi
  sleep 0.1
done

"$bin_dir/sandbar-bench" tls --plain "127.0.0.1:$plain" --https "127.0.0.1:$https" \
  --ca "$work/tls/ca.pem" "$@"
