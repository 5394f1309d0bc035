#!/usr/bin/env bash
# The whole test suite: the deployment checks, formatting and lints, Rust unit and integration
# tests, then the end-to-end suite that drives a real `sandbar serve` with the official E2B
# Python SDK.
# Needs root (sandboxes use namespaces, cgroups and nftables).
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "$0")/common.sh"
# Sandboxes need root (namespaces, cgroups, nftables); run as another user, this asks sudo.
as_root "$@"
cd "$(dirname "$0")/.."

# How long each phase took, printed at the end (also after a failure) to see where a run's
# time goes.
phase_names=() phase_secs=() phase_started=$SECONDS
phase() {
  phase_names+=("$1")
  phase_secs+=($((SECONDS - phase_started)))
  phase_started=$SECONDS
}
report_phases() {
  echo "test.sh phases (seconds):"
  for i in "${!phase_names[@]}"; do echo "  ${phase_names[$i]}: ${phase_secs[$i]}"; done
  echo "  (last phase, unfinished or e2e): $((SECONDS - phase_started)); total: $SECONDS"
}
trap report_phases EXIT

./scripts/install-deps.sh --test
phase "host packages"
# CRIU 4.1.1 with our patches, for the checkpoint tests (does nothing when already installed;
# those tests are skipped, with the server's reason, only when the server finds it unusable).
./scripts/install-criu.sh
phase "criu"
python3 -m pip install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt \
  -r tests/deploy/requirements.txt
# An older release of the Python SDK in a virtualenv of its own, for the e2e check that code
# pinned to it keeps working (installed once per machine).
old_sdk=/var/tmp/sandbar-e2e-sdk-2.45
if ! "$old_sdk/bin/python3" -c 'import e2b' 2>/dev/null; then
  rm -rf "$old_sdk"
  python3 -m venv "$old_sdk"
  "$old_sdk/bin/pip" install --quiet --disable-pip-version-check e2b==2.45.1
fi
npm ci --prefix tests/e2e/js --no-audit --no-fund --silent
phase "python and npm packages"

# The Helm chart rendered by Helm's engine and validated against Kubernetes' schemas, and the
# systemd units verified (offline, a few seconds).
python3 -m pytest tests/deploy -q -p no:cacheprovider
phase "deploy checks"

# A fresh clone builds into a target directory kept on this machine between runs, so that
# only what changed is compiled again; a checkout with its own target/ keeps it. The cache is
# dropped when it outgrows its bound (cargo keeps every old artifact) or the disk runs short.
# rustc's incremental cache knows sources by their absolute path, and each fresh clone has a
# path of its own (every workspace crate compiled from scratch: 594 s instead of about 30), so
# a fresh clone is built in one checkout kept beside the cache: git brings it to this commit
# and rewrites only the files that changed, which also keeps the others' times, and cargo
# compiles again only the crates whose files changed. A clone with changes of its own (not
# yet committed) is built where it is.
build_cache=${SANDBAR_BUILD_CACHE:-/var/cache/sandbar-build/target}
build_dir=$PWD
if [[ ! -e target && $build_cache != none ]]; then
  mkdir -p "$build_cache"
  cache_gib=$(( $(du -sk "$build_cache" | cut -f1) >> 20 ))
  free_gib=$(( $(stat -f -c '%a * %S' "$build_cache") / (1 << 30) ))
  if (( cache_gib > 30 || free_gib < 30 )); then
    echo "test.sh: dropping the build cache (${cache_gib} GiB, ${free_gib} GiB free)" >&2
    rm -rf "$build_cache" && mkdir -p "$build_cache"
  fi
  ln -s "$build_cache" target
  if [[ -z $(git status --porcelain 2>/dev/null) ]] && git rev-parse -q --verify HEAD >/dev/null; then
    build_dir=$(dirname "$build_cache")/checkout
    if ! git -C "$build_dir" rev-parse --git-dir >/dev/null 2>&1; then
      rm -rf "$build_dir"
      git init -q "$build_dir"
    fi
    git -C "$build_dir" fetch -q --no-tags --update-shallow "$PWD" HEAD
    git -C "$build_dir" checkout -q --force --detach FETCH_HEAD
    # Ignored files stay: the target link and the dashboard's installed front-end libraries.
    git -C "$build_dir" clean -q -f -d
    ln -sfn "$build_cache" "$build_dir/target"
    "$build_dir/scripts/install-deps.sh"
  fi
  # Every crate whose files are new to cargo is compiled again; rustc's incremental cache
  # reuses what did not change (the node's crates with nothing changed: 12 s instead of
  # 273 s). Only here: a checkout's own target/ keeps the profile that scripts/serve.sh
  # builds with, so the two do not rebuild each other's work.
  export CARGO_PROFILE_RELEASE_INCREMENTAL=true
fi
phase "build cache"

cargo fmt --all -- --check
cd "$build_dir"
cargo clippy --release --all-targets -- -D warnings
phase "fmt and clippy"
# Every target at once, tests included: built alone, the binaries would resolve the shared
# dependencies' features without the test-only ones, and `cargo test` would then compile most
# of the dependency graph a second time.
cargo build --release --workspace --all-targets
phase "build"
# A stopped server leaves its firewall table for the sandboxes that outlive it. One left by an
# older build, whose resolver rules went by port alone, would drop the traffic of any test
# that happens to get that port; with no sandbox interface left and no server running, the
# table is a leftover.
if ! compgen -G '/sys/class/net/sbx*' >/dev/null && ! pgrep -x sandbar >/dev/null; then
  nft delete table inet sandbar 2>/dev/null || true
fi
cargo test --release --workspace
phase "cargo test"
cd - >/dev/null

# The e2e servers allocate their disk pools' blocks up front (8 GiB for the shared server, a
# few more for the cluster and first-start suites), next to templates and snapshots: with
# less room than this, tests fail on ENOSPC far from the cause, so say it here first.
free_gib=$(( $(stat -f -c '%a * %S' /var/tmp) / (1 << 30) ))
if (( free_gib < 20 )); then
  echo "test.sh: warning: only ${free_gib} GiB free under /var/tmp; the e2e suites need about 20" >&2
  du -sh /var/tmp/* 2>/dev/null | sort -h | tail -5 >&2 || true
fi

python3 -m pytest tests/e2e -q -p no:cacheprovider --durations=20 "$@"
