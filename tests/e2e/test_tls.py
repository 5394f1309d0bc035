"""HTTPS at the edge: the stock SDKs given only E2B_DOMAIN, E2B_API_KEY and trust in the CA.

The shared server also listens HTTPS, with the CA and wildcard certificate for
sandbar.localhost that `sandbar cert` made for this run (conftest.py). The clients run inside
`tls_client_ns`, a network namespace where sandbar.localhost and every name under it resolve to
an address whose port 443 is that listener, so the SDKs build https://api.sandbar.localhost and
https://49983-<id>.sandbar.localhost from the domain alone, as they do against E2B.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

import pytest

from e2e_util import CREATED_IDS, JS_DIR, kill_quietly, make_tls_files, node_binary, wait_until

# The Python SDK's quick start, and what the SDK made of the domain.
QUICK_START = r"""
import json, os, uuid
from e2b import Sandbox, SandboxQuery

for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
    assert name not in os.environ, name
marker = "tls-py-" + uuid.uuid4().hex[:8]
sbx = Sandbox.create(timeout=120, metadata={"suite": marker})
print(json.dumps({"created": sbx.sandbox_id}), flush=True)
try:
    run = sbx.commands.run("echo hello")
    assert (run.exit_code, run.stdout) == (0, "hello\n"), run
    sbx.files.write("/tmp/over-https.txt", "written over https\n")
    assert sbx.files.read("/tmp/over-https.txt") == "written over https\n"
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": marker})).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id], listed
    print(json.dumps({"api_url": sbx.connection_config.api_url, "envd_url": sbx.envd_api_url}), flush=True)
finally:
    sbx.kill()
assert Sandbox.list(query=SandboxQuery(metadata={"suite": marker})).next_items() == []
print(json.dumps({"done": True}), flush=True)
"""

# A command that prints a line every 0.2 s for 6 s, streamed to the client.
STREAM = r"""
import json
from e2b import Sandbox

sbx = Sandbox.create(timeout=120)
print(json.dumps({"created": sbx.sandbox_id}), flush=True)
try:
    handle = sbx.commands.run("for i in $(seq 1 30); do echo line-$i; sleep 0.2; done", background=True)
    result = handle.wait(on_stdout=lambda line: print(json.dumps({"line": line}), flush=True))
    print(json.dumps({"exit_code": result.exit_code, "stdout": result.stdout}), flush=True)
finally:
    sbx.kill()
"""


def sdk_env(ns, sandbar, **extra: str):
    return ns.env(E2B_DOMAIN=sandbar.domain, E2B_API_KEY=sandbar.api_key, **extra)


def messages(output: str) -> List[dict]:
    found = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found


def remember_created(output: str) -> List[str]:
    """The sandboxes a client said it made, tied to this run for the leak check."""
    ids = [m["created"] for m in messages(output) if "created" in m]
    CREATED_IDS.update(ids)
    return ids


def kill_all_quietly(ids: List[str]) -> None:
    for sandbox_id in ids:
        kill_quietly(sandbox_id)


def served_leaf(sandbar) -> bytes:
    """The certificate a new handshake with the HTTPS listener gets, checked against the CA."""
    context = ssl.create_default_context(cafile=str(sandbar.tls_dir / "ca.pem"))
    with socket.create_connection(("127.0.0.1", sandbar.tls_port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=f"api.{sandbar.domain}") as tls:
            return tls.getpeercert(binary_form=True)


def leaf_on_disk(sandbar) -> bytes:
    pem = (sandbar.tls_dir / "cert.pem").read_text()
    first = pem.split("-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n"
    return ssl.PEM_cert_to_DER_cert(first)


def serial_and_start(der: bytes) -> str:
    out = subprocess.run(
        ["openssl", "x509", "-inform", "DER", "-noout", "-serial", "-startdate"],
        input=der, capture_output=True, check=True,
    ).stdout.decode()
    return " ".join(out.split())


def test_the_python_sdk_quick_start_with_only_the_domain(sandbar, tls_client_ns):
    env = sdk_env(tls_client_ns, sandbar, SSL_CERT_FILE=str(tls_client_ns.ca_path))
    done = tls_client_ns.run([sys.executable, "-c", QUICK_START], env=env, timeout=120)
    ids = remember_created(done.stdout)
    try:
        assert done.returncode == 0, f"quick start failed:\n{done.stdout}\n{done.stderr}"
        said = {k: v for m in messages(done.stdout) for k, v in m.items()}
        assert said["api_url"] == f"https://api.{sandbar.domain}"
        assert said["envd_url"] == f"https://49983-{ids[0]}.{sandbar.domain}"
        assert said["done"] is True
    finally:
        kill_all_quietly(ids)


def test_the_js_sdk_quick_start_with_only_the_domain(sandbar, tls_client_ns):
    env = sdk_env(tls_client_ns, sandbar, NODE_EXTRA_CA_CERTS=str(tls_client_ns.ca_path))
    done = tls_client_ns.run(
        [node_binary(), "--test", "--test-reporter=spec", str(JS_DIR / "tls_quickstart.test.mjs")],
        env=env, timeout=120, cwd=JS_DIR,
    )
    ids = remember_created(done.stdout)
    try:
        assert done.returncode == 0, f"node test failed:\n{done.stdout}\n{done.stderr}"
        assert ids, done.stdout
    finally:
        kill_all_quietly(ids)


def test_a_client_that_does_not_trust_the_ca_is_refused(sandbar, tls_client_ns):
    with tempfile.TemporaryDirectory(prefix="sandbar-e2e-other-ca-") as other:
        # A CA for the very same domain, just not the one that signed the server's certificate.
        make_tls_files(sandbar.binary, sandbar.domain, Path(other))
        env = sdk_env(tls_client_ns, sandbar, SSL_CERT_FILE=str(Path(other) / "ca.pem"))
        script = "from e2b import Sandbox\nSandbox.create(timeout=30)\nprint('created')\n"
        done = tls_client_ns.run([sys.executable, "-c", script], env=env, timeout=120)
    remember_created(done.stdout)
    assert done.returncode != 0, f"a create went through:\n{done.stdout}"
    assert "created" not in done.stdout
    assert "UnknownIssuer" in done.stderr or "certificate" in done.stderr.lower(), done.stderr[-2000:]


def test_sighup_serves_a_new_certificate_under_a_live_command_stream(sandbar, tls_client_ns):
    pid = sandbar.pid
    old = served_leaf(sandbar)
    assert old == leaf_on_disk(sandbar)
    env = sdk_env(tls_client_ns, sandbar, SSL_CERT_FILE=str(tls_client_ns.ca_path))
    client = tls_client_ns.popen(
        [sys.executable, "-c", STREAM], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    output: List[str] = []
    ids: List[str] = []
    try:
        assert client.stdout is not None
        # Renewed once the stream is under way.
        for line in client.stdout:
            output.append(line)
            ids = remember_created("".join(output))
            if any("line" in m for m in messages(line)):
                break
        assert ids, "".join(output) + (client.stderr.read() if client.stderr else "")

        renewed = make_tls_files(sandbar.binary, sandbar.domain, sandbar.tls_dir, force=True)
        assert "signed by the CA already there" in renewed, renewed
        new = leaf_on_disk(sandbar)
        assert new != old
        # To the process a service manager knows (`kill -HUP $MAINPID`), which passes it on.
        sandbar.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: served_leaf(sandbar) == new, timeout=10, message="the new certificate served")
        reloaded_at = len(output)
        assert serial_and_start(served_leaf(sandbar)) == serial_and_start(new)
        assert serial_and_start(new).split()[0] != serial_and_start(old).split()[0]

        for line in client.stdout:
            output.append(line)
        client.wait(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
        kill_all_quietly(ids)
    stderr = client.stderr.read() if client.stderr else ""
    text = "".join(output)
    assert client.returncode == 0, f"the client failed:\n{text}\n{stderr[-3000:]}"
    result = [m for m in messages(text) if "exit_code" in m]
    assert result and result[0]["exit_code"] == 0, text
    assert result[0]["stdout"] == "".join(f"line-{i}\n" for i in range(1, 31)), result[0]["stdout"]
    after = [m for m in messages("".join(output[reloaded_at:])) if "line" in m]
    assert len(after) >= 5, f"the stream must go on after the reload: {text}"
    assert sandbar.proc.poll() is None and sandbar.pid == pid, "the server must not restart"
    log = Path(sandbar.log_path).read_text(errors="replace")
    assert "SIGHUP: new TLS handshakes get the certificate read again" in log
