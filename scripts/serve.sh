#!/usr/bin/env bash
# Builds Sandbar and starts it with the default template (built on first start, then cached).
# Arguments are passed to `sandbar serve`; see `target/release/sandbar serve --help`.
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "$0")/common.sh"
# Sandboxes need root (namespaces, cgroups, nftables); run as another user, this asks sudo.
as_root "$@"
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# CRIU lets paused sandboxes go to disk and makes snapshots and forks possible; built once
# (about half a minute), then found installed. Without it the server still runs, pausing in
# memory only.
if ! ./scripts/install-criu.sh; then
  echo "serve.sh: CRIU could not be installed; paused sandboxes stay in memory and snapshots copy files only" >&2
fi
cargo build --release --bin sandbar --bin sandbar-agent --bin sandbar-interpreter
exec ./target/release/sandbar serve "$@"
