#!/bin/sh
# The desktop template's start command: an X server on display :0 at the desktop SDKs'
# default geometry and DPI, and an Xfce session on it. The template is captured once this is
# ready, so a new sandbox starts with its desktop already drawn.
export DISPLAY=:0
/usr/bin/Xvfb :0 -ac -screen 0 1024x768x24 -retro -dpi 96 -nolisten tcp -nolisten unix &
tries=0
until /usr/bin/xdpyinfo -display :0 >/dev/null 2>&1; do
  tries=$((tries + 1))
  if [ "$tries" -gt 100 ]; then
    echo "the X server did not start on :0" >&2
    exit 1
  fi
  sleep 0.1
done
# An idle desktop is never blanked: a screenshot shows what is on the screen.
xset s off -dpms s noblank
# The session's bus on an abstract socket, as the X server's: a socket bound to a path
# cannot be restored from the template's capture, and Debian's session bus binds one.
DBUS_SESSION_BUS_ADDRESS=$(dbus-daemon --session --fork --nopidfile --print-address \
  --address=unix:abstract=/tmp/.sandbar-session-bus) || exit 1
export DBUS_SESSION_BUS_ADDRESS
exec /usr/bin/startxfce4
