#!/usr/bin/env bash
# Registry pull benchmark: starts a private `docker-registry` on a free port of 127.0.0.1 with
# storage in a temporary directory, builds a fixture image, pushes it there with skopeo, and
# runs `sandbar-bench pull` against it (ImageCache::pull vs skopeo copy + umoci unpack, each
# into empty directories). Everything it started or created is gone when it exits.
#
# The fixture is the default template's Debian root filesystem if it is there
# ($SANDBAR_BENCH_ROOTFS, default /var/tmp/sandbar-e2e/templates/base-v2/rootfs), in three
# layers: everything but /usr's contents, /usr without /usr/share's contents, /usr/share.
# Otherwise it is a busybox-static root in two layers.
#
# Arguments go to `sandbar-bench pull` (e.g. --iterations 10 --raw-unpack). Must run as root:
# the fixture keeps the root filesystem's owners and device nodes. Needs docker-registry,
# umoci, skopeo and curl (`apt-get install docker-registry umoci skopeo busybox-static`).
# Nothing is contacted but 127.0.0.1. Environment:
#   SANDBAR_BENCH_ROOTFS  root filesystem for the fixture image (see above)
#   TMPDIR                parent of the temporary directory (default /var/tmp: the fixture,
#                         the registry's storage and every pull's output go there)
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

if [[ $EUID -ne 0 ]]; then
  echo "bench-pull.sh: must run as root" >&2
  exit 1
fi
for tool in docker-registry umoci skopeo curl tar setpriv; do
  if ! command -v "$tool" >/dev/null; then
    echo "bench-pull.sh: $tool is missing" >&2
    exit 1
  fi
done

rootfs="${SANDBAR_BENCH_ROOTFS:-/var/tmp/sandbar-e2e/templates/base-v2/rootfs}"
work="$(mktemp -d "${TMPDIR:-/var/tmp}/sandbar-bench-pull.XXXXXX")"
registry_pid=""
stop_registry() {
  if [[ -n "$registry_pid" ]] && kill -0 "$registry_pid" 2>/dev/null; then
    kill -TERM "$registry_pid" 2>/dev/null || true
    wait "$registry_pid" 2>/dev/null || true
  fi
  registry_pid=""
}
cleanup() {
  stop_registry
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cargo build --release -p sandbar-bench
bench=./target/release/sandbar-bench

# --- registry -------------------------------------------------------------------------------

# free_port (common.sh) gives a port nothing accepts connections on; docker-registry failing
# to bind it anyway (another process took it meanwhile) is caught below and retried with
# another one.

start_registry() {
  local port secret deadline
  port="$(free_port)" || return 1
  secret="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  mkdir -p "$work/storage"
  cat >"$work/registry.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
  fields:
    service: sandbar-bench-pull
storage:
  filesystem:
    rootdirectory: $work/storage
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:$port
  secret: $secret
EOF
  # --pdeathsig: the registry goes with this script even if the script is killed outright.
  setpriv --pdeathsig TERM docker-registry serve "$work/registry.yml" \
    </dev/null >>"$work/registry.log" 2>&1 &
  registry_pid=$!
  deadline=$((SECONDS + 20))
  while kill -0 "$registry_pid" 2>/dev/null && ((SECONDS < deadline)); do
    if curl -fsS -o /dev/null "http://127.0.0.1:$port/v2/" 2>/dev/null; then
      registry="127.0.0.1:$port"
      return 0
    fi
    sleep 0.1
  done
  stop_registry
  return 1
}

registry=""
for _ in 1 2 3 4 5; do
  if start_registry; then
    break
  fi
done
if [[ -z "$registry" ]]; then
  echo "bench-pull.sh: docker-registry did not start:" >&2
  tail -n 20 "$work/registry.log" >&2 || true
  exit 1
fi
echo "bench-pull.sh: registry on $registry (storage in $work/storage)" >&2

# --- fixture image --------------------------------------------------------------------------

layout="$work/layout"
bundle="$work/bundle"
umoci init --layout "$layout"
umoci new --image "$layout:fixture"
umoci unpack --image "$layout:fixture" "$bundle"

# add_layer DESCRIPTION SOURCE TAR-ARGS...: copies what `tar -C SOURCE TAR-ARGS` selects into
# the bundle (owners, modes and times kept) and commits the difference as one layer.
add_layer() {
  local what="$1" src="$2"
  shift 2
  tar -C "$src" -cf - "$@" | tar -C "$bundle/rootfs" -xpf - --numeric-owner
  # --refresh-bundle: the next layer holds only what is copied after this one.
  umoci repack --refresh-bundle --image "$layout:fixture" \
    --history.created_by "bench-pull.sh: $what" "$bundle"
}

if [[ -d "$rootfs/usr/share" ]]; then
  source_desc="$rootfs"
  add_layer "root without /usr contents" "$rootfs" --exclude='./usr/*' .
  add_layer "/usr without /usr/share contents" "$rootfs" --exclude='./usr/share/*' ./usr
  add_layer "/usr/share" "$rootfs" ./usr/share
  cmd=/bin/bash
else
  busybox="$(command -v busybox)" || {
    echo "bench-pull.sh: no $rootfs and no busybox for a fallback fixture" >&2
    exit 1
  }
  source_desc="busybox ($busybox)"
  src="$work/busybox-root"
  mkdir -p "$src"/{bin,etc,root,tmp}
  cp "$busybox" "$src/bin/busybox"
  for applet in $("$busybox" --list); do
    [[ "$applet" == busybox ]] || ln -sf busybox "$src/bin/$applet"
  done
  echo "root:x:0:0:root:/root:/bin/sh" >"$src/etc/passwd"
  echo "root:x:0:" >"$src/etc/group"
  chmod 1777 "$src/tmp"
  chmod 700 "$src/root"
  add_layer "root without /bin contents" "$src" --exclude='./bin/*' .
  add_layer "/bin (busybox)" "$src" ./bin
  cmd=/bin/sh
fi
umoci config --image "$layout:fixture" \
  --config.env "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --config.cmd "$cmd" --config.workingdir / --history.created_by "bench-pull.sh: config"
umoci gc --layout "$layout"
rm -rf "$bundle"

image="$registry/bench/fixture:1"
skopeo --insecure-policy --tmpdir "$work" copy --quiet --dest-tls-verify=false \
  "oci:$layout:fixture" "docker://$image"
rm -rf "$layout"
echo "bench-pull.sh: pushed $image, built from $source_desc" >&2

# --- benchmark ------------------------------------------------------------------------------

mkdir "$work/runs"
"$bench" pull --image "$image" --tmp-dir "$work/runs" "$@"
