"""The registry rule: a template build's `fromImage` (or a Dockerfile's `FROM`) never makes the
server connect to loopback, not even to its own port, unless the operator allowed the registry.

A plain TCP listener of the test's own on 127.0.0.1 counts the connections it accepts; builds
naming it (by address and by the name `localhost`) and builds naming the server's own port are
answered 400 with the rule, before anything connects. The local registries the suite allowed
with `--allow-registry 127.0.0.1:<port>` still serve pulls. Nothing here leaves loopback.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator, Tuple

import pytest

from e2e_util import build_log_messages, unique, wait_build_end

BUILD_TIMEOUT = 300


class CountingListener:
    """Accepts (and closes) connections on a free port of 127.0.0.1, counting them."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self._accepted = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"listener-{self.port}")
        self._thread.start()

    @property
    def accepted(self) -> int:
        with self._lock:
            return self._accepted

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self._accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def listener() -> Iterator[CountingListener]:
    counting = CountingListener()
    try:
        yield counting
    finally:
        counting.close()


def _requested_build(api) -> Tuple[str, str]:
    r = api.post("/v3/templates", json={"name": unique("registry-rule")})
    assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
    return r.json()["templateID"], r.json()["buildID"]


def _assert_refused(r, registry: str) -> str:
    assert r.status_code == 400, f"expected 400, got {r.status_code} {r.text}"
    body = r.json()
    assert body.get("code") == 400, body
    message = body.get("message", "")
    assert f"registry {registry} resolves to " in message, message
    assert "a loopback address" in message and "--allow-registry" in message, message
    return message


@pytest.mark.parametrize("target", ["listener", "listener-by-name", "server"])
def test_builds_from_loopback_are_refused_before_any_connection(sandbar, listener, target):
    host, port = {
        "listener": ("127.0.0.1", listener.port),
        "listener-by-name": ("localhost", listener.port),
        "server": ("127.0.0.1", sandbar.port),
    }[target]
    registry = f"{host}:{port}"
    image = f"{registry}/x/y"
    with sandbar.client() as api:
        template_id, build_id = _requested_build(api)
        try:
            r = api.post(f"/v2/templates/{template_id}/builds/{build_id}", json={"fromImage": image})
            message = _assert_refused(r, registry)
            assert image in message, message

            # Nothing was queued: the build still waits for a valid start.
            s = api.get(f"/templates/{template_id}/builds/{build_id}/status")
            assert s.status_code == 200, f"{s.status_code} {s.text}"
            assert s.json()["status"] == "waiting", s.json()

            # A Dockerfile naming it is refused when the template is created.
            alias = unique("registry-rule-df")
            r = api.post("/templates", json={"dockerfile": f"FROM {image}\nRUN true\n", "alias": alias})
            _assert_refused(r, registry)
            names = [n for t in api.get("/templates").json() for n in (t.get("aliases") or [])]
            assert alias not in names
        finally:
            api.delete(f"/templates/{template_id}")

    # Give anything queued behind the answer time to show up.
    time.sleep(1)
    assert listener.accepted == 0, f"the server connected to the listener {listener.accepted} times"


def test_an_allowed_local_registry_still_serves_pulls(sandbar, registry):
    with sandbar.client() as api:
        template_id, build_id = _requested_build(api)
        try:
            r = api.post(
                f"/v2/templates/{template_id}/builds/{build_id}",
                json={"fromImage": registry.image("e2e/tiny:1")},
            )
            assert r.status_code == 202, f"POST build: {r.status_code} {r.text}"
            status = wait_build_end(api, template_id, build_id, timeout=BUILD_TIMEOUT, interval=0.5)
            logs = "\n".join(build_log_messages(status))
            assert status["status"] == "ready", f"{status.get('reason')}\n{logs}"
        finally:
            api.delete(f"/templates/{template_id}")
