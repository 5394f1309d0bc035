"""Routing of requests to sandboxes: user ports by header and by Host, envd health and auth."""

import secrets
import socket
from urllib.parse import urlparse

import httpx
import pytest

from e2e_util import ENVD_PORT, wait_until

UNKNOWN_ID = "inotexisting0000000000"


def _headers(sandbox_id, port):
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}


@pytest.fixture
def web_sandbox(sandbox, sandbar):
    """A sandbox serving /home/user/site on port 8000 (python http.server)."""
    marker = "routing-marker-" + secrets.token_hex(6)
    sandbox.files.write(f"/home/user/site/{marker}.txt", "hello from the sandbox\n")
    h = sandbox.commands.run(
        "python3 -m http.server 8000 --bind 0.0.0.0", background=True, cwd="/home/user/site", timeout=0
    )
    wait_until(
        lambda: httpx.get(sandbar.url + "/", headers=_headers(sandbox.sandbox_id, 8000), timeout=5).status_code
        == 200,
        timeout=30,
        interval=0.5,
        message="the sandbox web server through the proxy",
    )
    try:
        yield sandbox, marker
    finally:
        try:
            h.kill()
        except Exception:  # noqa: BLE001
            pass


def test_user_port_by_headers(web_sandbox, sandbar):
    sbx, marker = web_sandbox
    r = httpx.get(sandbar.url + "/", headers=_headers(sbx.sandbox_id, 8000), timeout=10)
    assert r.status_code == 200
    assert "Directory listing" in r.text
    assert f"{marker}.txt" in r.text
    r = httpx.get(f"{sandbar.url}/{marker}.txt", headers=_headers(sbx.sandbox_id, 8000), timeout=10)
    assert r.status_code == 200
    assert r.text == "hello from the sandbox\n"
    r = httpx.get(f"{sandbar.url}/no-such-file", headers=_headers(sbx.sandbox_id, 8000), timeout=10)
    assert r.status_code == 404, "the upstream status must pass through the proxy"


def test_user_port_by_host_header(web_sandbox, sandbar):
    sbx, marker = web_sandbox
    for host in (f"8000-{sbx.sandbox_id}.{sandbar.domain}", f"8000-{sbx.sandbox_id}.{sandbar.domain}:{sandbar.port}"):
        r = httpx.get(sandbar.url + "/", headers={"Host": host}, timeout=10)
        assert r.status_code == 200, f"Host {host}: {r.status_code} {r.text[:200]}"
        assert f"{marker}.txt" in r.text
    # get_host() names the same host
    assert sbx.get_host(8000) == f"8000-{sbx.sandbox_id}.{sandbar.domain}"


def test_user_port_request_body_and_query_pass_through(web_sandbox, sandbar):
    sbx, marker = web_sandbox
    r = httpx.get(
        f"{sandbar.url}/{marker}.txt?x=1&y=%20z", headers=_headers(sbx.sandbox_id, 8000), timeout=10
    )
    assert r.status_code == 200
    # http.server answers 501 to POST: the method must reach the upstream unchanged
    r = httpx.post(sandbar.url + "/", content=b"abc", headers=_headers(sbx.sandbox_id, 8000), timeout=10)
    assert r.status_code == 501


# A server that switches to its own protocol on an upgrade and then echoes in capitals, from
# Python's standard library alone (the default template has no WebSocket package).
UPGRADING_SERVER = r"""
import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", 8765))
server.listen()
while True:
    conn, _ = server.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(1024)
        if not chunk:
            break
        head += chunk
    if b"upgrade: shout" in head.lower():
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: shout\r\n\r\n")
        while True:
            data = conn.recv(1024)
            if not data:
                break
            conn.sendall(data.upper())
    else:
        conn.sendall(b"HTTP/1.1 426 Upgrade Required\r\ncontent-length: 0\r\n\r\n")
    conn.close()
"""


def test_a_port_switches_protocols_through_the_edge(sandbox, sandbar):
    """WebSockets (noVNC's stream, a dev server's reload) need the upgrade carried to the
    sandbox's port and the two connections joined after its 101."""
    sandbox.files.write("/home/user/upgrading.py", UPGRADING_SERVER)
    h = sandbox.commands.run("python3 /home/user/upgrading.py", background=True, timeout=0)
    host = f"8765-{sandbox.sandbox_id}.{sandbar.domain}"
    address = urlparse(sandbar.url)
    try:
        wait_until(
            lambda: httpx.get(sandbar.url + "/", headers={"Host": host}, timeout=5).status_code == 426,
            timeout=30,
            interval=0.5,
            message="the upgrading server through the edge",
        )
        with socket.create_connection((address.hostname, address.port), timeout=10) as conn:
            conn.sendall(
                f"GET /shout HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: shout\r\n\r\n".encode()
            )
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(1024)
            assert head.startswith(b"HTTP/1.1 101"), head
            for word in (b"hello", b"through the edge"):
                conn.sendall(word)
                got = b""
                while len(got) < len(word):
                    got += conn.recv(1024)
                assert got == word.upper()
    finally:
        h.kill()


def test_closed_port_in_live_sandbox(sandbox, sandbar):
    r = httpx.get(sandbar.url + "/", headers=_headers(sandbox.sandbox_id, 8001), timeout=30)
    assert r.status_code == 502
    assert "sandbox was not found" not in r.text, "a closed port must not be reported as a missing sandbox"


def test_unknown_sandbox_gives_502(sandbar):
    for port in (8000, ENVD_PORT):
        r = httpx.get(sandbar.url + "/", headers=_headers(UNKNOWN_ID, port), timeout=10)
        assert r.status_code == 502, f"port {port}: {r.status_code} {r.text}"
        assert "sandbox was not found" in r.text
        assert isinstance(r.json(), dict)
    r = httpx.get(sandbar.url + "/", headers={"Host": f"8000-{UNKNOWN_ID}.{sandbar.domain}"}, timeout=10)
    assert r.status_code == 502
    assert "sandbox was not found" in r.text


def test_killed_sandbox_gives_502(make_sandbox, sandbar):
    sbx = make_sandbox()
    assert sbx.is_running() is True
    sid = sbx.sandbox_id
    sbx.kill()
    assert sbx.is_running() is False
    r = httpx.get(sandbar.url + "/health", headers=_headers(sid, ENVD_PORT), timeout=10)
    assert r.status_code == 502
    assert "sandbox was not found" in r.text


def test_envd_health_by_headers(sandbox, sandbar):
    r = httpx.get(sandbar.url + "/health", headers=_headers(sandbox.sandbox_id, ENVD_PORT), timeout=10)
    assert r.status_code == 204, f"{r.status_code} {r.text}"
    # by Host as well
    r = httpx.get(
        sandbar.url + "/health", headers={"Host": f"{ENVD_PORT}-{sandbox.sandbox_id}.{sandbar.domain}"}, timeout=10
    )
    assert r.status_code == 204, f"{r.status_code} {r.text}"


def _list_processes(sandbar, sandbox_id, token=None):
    headers = {
        **_headers(sandbox_id, ENVD_PORT),
        "Content-Type": "application/json",
        "Connect-Protocol-Version": "1",
    }
    if token is not None:
        headers["X-Access-Token"] = token
    return httpx.post(sandbar.url + "/process.Process/List", content=b"{}", headers=headers, timeout=10)


def test_envd_rpc_requires_access_token(make_sandbox, sandbar):
    a = make_sandbox()
    b = make_sandbox()
    token_a = a._envd_access_token
    assert token_a
    # positive control
    r = _list_processes(sandbar, a.sandbox_id, token_a)
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    assert "processes" in r.json() or r.json() == {}
    # missing token
    r = _list_processes(sandbar, a.sandbox_id)
    assert r.status_code == 401, f"{r.status_code} {r.text}"
    # wrong token
    r = _list_processes(sandbar, a.sandbox_id, "wrong-" + secrets.token_hex(8))
    assert r.status_code == 401
    # another sandbox's token
    r = _list_processes(sandbar, b.sandbox_id, token_a)
    assert r.status_code == 401
    # the file endpoints want a token or a signature too
    r = httpx.get(
        sandbar.url + "/files",
        params={"path": "/etc/hostname"},
        headers=_headers(a.sandbox_id, ENVD_PORT),
        timeout=10,
    )
    assert r.status_code == 401, f"{r.status_code} {r.text}"
    r = httpx.get(
        sandbar.url + "/files",
        params={"path": "/etc/hostname"},
        headers={**_headers(a.sandbox_id, ENVD_PORT), "X-Access-Token": token_a},
        timeout=10,
    )
    assert r.status_code == 200


def test_envd_start_stream_by_raw_http(sandbox, sandbar):
    """One Connect server-streaming call made by hand: start, data, end, then the end-of-stream frame."""
    import json
    import struct

    body = json.dumps({"process": {"cmd": "/bin/echo", "args": ["raw-connect"]}}).encode()
    frame = b"\x00" + struct.pack(">I", len(body)) + body
    r = httpx.post(
        sandbar.url + "/process.Process/Start",
        content=frame,
        headers={
            **_headers(sandbox.sandbox_id, ENVD_PORT),
            "X-Access-Token": sandbox._envd_access_token,
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
        },
        timeout=30,
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/connect+json")
    data = r.content
    msgs = []
    while data:
        flags, n = data[0], struct.unpack(">I", data[1:5])[0]
        msgs.append((flags, json.loads(data[5 : 5 + n] or b"{}")))
        data = data[5 + n :]
    assert msgs[0][0] == 0 and "start" in msgs[0][1]["event"], msgs
    assert msgs[-1][0] & 0x02, "the stream must end with an end-of-stream frame"
    assert "error" not in msgs[-1][1], msgs[-1]
    events = [m[1]["event"] for m in msgs[:-1]]
    ends = [e["end"] for e in events if "end" in e]
    assert len(ends) == 1
    assert ends[0].get("exitCode", 0) == 0
    import base64

    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e and "stdout" in e["data"])
    assert out == b"raw-connect\n"


def test_is_running_true_then_false(make_sandbox):
    sbx = make_sandbox()
    assert sbx.is_running() is True
    sbx.kill()
    assert sbx.is_running() is False
