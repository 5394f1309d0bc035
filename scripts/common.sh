# shellcheck shell=bash
# Shell functions the scripts in this directory share: sourced (`. "$(dirname "$0")/common.sh"`),
# never run on its own.

# Runs the sourcing script again through sudo, with the arguments given (`as_root "$@"`), when
# it is not root; stops it where there is no sudo.
as_root() {
  if [[ $EUID -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
      exec sudo "$0" "$@"
    fi
    echo "$(basename "$0"): run it as root" >&2
    exit 1
  fi
}

# A TCP port of 127.0.0.1 nothing accepts connections on, printed; fails (saying so) when 50
# tries found none. Another process may still take it before it is used.
free_port() {
  local candidate
  for _ in $(seq 1 50); do
    candidate=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$candidate") 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "$(basename "$0"): no free port found" >&2
  return 1
}
