#!/usr/bin/env bash
# Installs the host packages Sandbar needs (Debian/Ubuntu, as root): mmdebstrap builds the default
# template, nftables and iproute2 wire sandbox networks, util-linux provides mount and nsenter,
# btrfs-progs makes the pool that holds sandbox disks under quota; npm installs the dashboard's
# front-end libraries, which the build embeds.
# Pass --test to also install what the test suite and benchmark use (the custom-template tests run
# local registries with docker-registry, build images with umoci from busybox-static, push them with
# skopeo, and make the registry password with htpasswd from apache2-utils; the store's tests and the
# PostgreSQL e2e test start throwaway clusters with postgresql-15's initdb and pg_ctl; the
# dashboard's and desktop stream's tests drive Debian's chromium with Playwright, which never
# downloads a browser, and trust the test CA through an NSS database made with libnss3-tools' certutil).
set -euo pipefail

packages=(mmdebstrap nftables iproute2 util-linux ca-certificates btrfs-progs)
command -v npm >/dev/null || packages+=(nodejs npm)
if [[ "${1:-}" == "--test" ]]; then
  packages+=(python3-pip runc procps docker-registry umoci skopeo busybox-static apache2-utils postgresql-15 chromium libnss3-tools)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  if [[ " ${missing[*]} " == *" postgresql-15 "* ]]; then
    # Tests start clusters of their own on Unix sockets; the package's default cluster would
    # only be one more server listening on the host.
    mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/sandbar-tests.conf
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The dashboard's htmx and xterm.js, pinned by its package-lock.json; the build embeds them.
web="$(cd "$(dirname "$0")/.." && pwd)/crates/dashboard/web"
# Installed again only when the lock file changed since the last install.
if ! cmp -s "$web/package-lock.json" "$web/node_modules/.installed-lock.json" 2>/dev/null; then
  npm ci --prefix "$web" --no-audit --no-fund --silent
  cp "$web/package-lock.json" "$web/node_modules/.installed-lock.json"
fi
