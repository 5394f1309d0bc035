#!/usr/bin/env bash
# Builds Sandbar and starts it with the default template (built on first start, then cached).
# Arguments are passed to `sandbar serve`; see `target/release/sandbar serve --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cargo build --release --bin sandbar --bin sandbar-agent
exec ./target/release/sandbar serve "$@"
