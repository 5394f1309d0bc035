#!/usr/bin/env bash
# The whole test suite: formatting and lints, Rust unit and integration tests, then the
# end-to-end suite that drives a real `sandbar serve` with the official E2B Python SDK.
# Needs root (sandboxes use namespaces, cgroups and nftables).
set -euo pipefail
# Sandboxes need root (namespaces, cgroups, nftables); run as another user, this asks sudo.
if [[ $EUID -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo "$0" "$@"
  fi
  echo "$(basename "$0"): run it as root" >&2
  exit 1
fi
cd "$(dirname "$0")/.."

./scripts/install-deps.sh --test
# CRIU 4.1.1 with our patches, for the checkpoint tests (does nothing when already installed;
# those tests are skipped, with the server's reason, only when the server finds it unusable).
./scripts/install-criu.sh
python3 -m pip install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt
npm ci --prefix tests/e2e/js --no-audit --no-fund --silent

cargo fmt --all -- --check
cargo clippy --release --all-targets -- -D warnings
cargo build --release --bin sandbar --bin sandbar-agent
cargo test --release --workspace

python3 -m pytest tests/e2e -q -p no:cacheprovider "$@"
