#!/usr/bin/env bash
# Builds and installs CRIU 4.1.1 into /usr/local (as root, Debian 12). Debian 12's own criu 3.17
# fails `criu check` on current kernels (vDSO layout), so Sandbar calls /usr/local/sbin/criu by
# absolute path and never the one in /usr/sbin. The source is Debian trixie's orig tarball, pinned
# by sha256, with the small patches in scripts/criu/ that checkpointing a sandbox needs (each
# explains itself; see docs/checkpoint.md). Idempotent: does nothing when /usr/local/sbin/criu
# already reports this version and was built with the same patches.
# Disk-persistent pause stays off on hosts where this script was not run or `criu check` fails.
set -euo pipefail

version=4.1.1
sha256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
url="http://deb.debian.org/debian/pool/main/c/criu/criu_${version}.orig.tar.xz"
prefix=/usr/local
criu="$prefix/sbin/criu"
patches_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/criu"
stamp="$prefix/share/sandbar/criu-patches.sha256"
patches_sum=$(cat "$patches_dir"/*.patch | sha256sum | cut -d' ' -f1)

if [[ -x "$criu" ]] && "$criu" --version 2>/dev/null | grep -qx "Version: $version" &&
  [[ "$(cat "$stamp" 2>/dev/null)" == "$patches_sum" ]]; then
  echo "criu $version already installed at $criu"
  exit 0
fi

# Build dependencies (the subset of Debian's Build-Depends the criu binary needs; the docs,
# the python bindings and the plugins are not built).
packages=(gcc make pkgconf python3 python3-protobuf libbsd-dev libcap-dev libgnutls28-dev
  libnet1-dev libnftables-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler
  protobuf-compiler uuid-dev iproute2 curl xz-utils ca-certificates patch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing build dependencies: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

work=$(mktemp -d /tmp/criu-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
tarball="$work/criu-$version.tar.xz"
curl -fsSL -o "$tarball" "$url"
echo "$sha256  $tarball" | sha256sum -c --quiet -
tar -C "$work" -xf "$tarball"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'criu*' | head -n1)
for p in "$patches_dir"/*.patch; do
  patch -d "$src" -p1 --quiet <"$p"
done

start=$(date +%s)
# Only the criu binary: `make install` would also want asciidoc/xmlto for the man pages.
make -C "$src" -j"$(nproc)" criu >"$work/build.log" 2>&1 || {
  tail -n 40 "$work/build.log"
  exit 1
}
install -D -m 0755 "$src/criu/criu" "$criu"
install -D -m 0644 /dev/stdin "$stamp" <<<"$patches_sum"
echo "built criu $version in $(($(date +%s) - start)) s"

"$criu" --version
"$criu" check
