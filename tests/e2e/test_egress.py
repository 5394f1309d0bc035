"""Egress rules (`network.allow_out` / `deny_out`), the default refusal of private destinations,
the sandboxes' resolver, `update_network`, and user-port access (`allow_public_traffic`,
`mask_request_host`), driven with the official Python SDK.

The only network peers are loopback, the sandboxes, and a network namespace this module creates
(`sbtest-egr-*`) that stands in for the internet: it serves HTTP on a few "public" addresses of the
retired 6to4 relay range and on private, shared and metadata addresses, each reached through a
/32 route the fixture adds, checks and removes. Names resolve through the suite's fake upstream
resolver (`fake_dns`), never a real one.
"""

import secrets
import shlex
import time

import httpx
import pytest
from e2b import CommandExitException, Sandbox
from e2b.sandbox.network import ALL_TRAFFIC

from e2e_util import stand_in_web, wait_until

PUBLIC_A, PUBLIC_B, PUBLIC_C, PUBLIC_D = ("192.88.99.21", "192.88.99.22", "192.88.99.23", "192.88.99.24")
PRIVATE = ("10.255.78.7", "100.100.100.200", "168.63.129.16")


def run_rc(sbx, cmd, timeout=60):
    try:
        r = sbx.commands.run(cmd, timeout=timeout)
        return r.exit_code, r.stdout, r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout, e.stderr


def fetch_cmd(url, timeout=3):
    return "python3 -c " + shlex.quote(
        f"import urllib.request;r=urllib.request.urlopen({url!r},timeout={timeout});print(r.status);print(r.read().decode())"
    )


def resolve_cmd(name):
    return "python3 -c " + shlex.quote(f"import socket;print(socket.gethostbyname({name!r}))")


@pytest.fixture(scope="module")
def internet():
    """A namespace serving HTTP on PUBLIC_* and PRIVATE, reached through /32 host routes."""
    served_all = (PUBLIC_A, PUBLIC_B, PUBLIC_C, PUBLIC_D, *PRIVATE)
    with stand_in_web("sbtest-egr-", "sbte", "10.253", served_all, "sbtest-egr-www-", "egress-") as (ns, port, marker, log_path):
        for served in served_all:
            url = f"http://{served}:{port}/marker.txt"
            wait_until(lambda: httpx.get(url, timeout=2).text == marker, timeout=20, message=f"the web server on {served}")
        yield {"port": port, "marker": marker, "log": log_path}


def url_of(internet, host, path="marker.txt"):
    return f"http://{host}:{internet['port']}/{path}"


def reaches(sbx, internet, host):
    """Whether the sandbox gets the marker from `host`; a refusal must also leave no trace."""
    probe = "probe-" + secrets.token_hex(6)
    rc, out, _ = run_rc(sbx, fetch_cmd(url_of(internet, host, probe)), timeout=30)
    time.sleep(0.2)
    logged = probe in internet["log"].read_text(errors="replace")
    if rc != 0 and not logged:
        return False
    # 404 for the probe path still proves the packet arrived; ask for the marker to be sure.
    rc, out, _ = run_rc(sbx, fetch_cmd(url_of(internet, host)), timeout=30)
    assert rc == 0 and out.splitlines()[1] == internet["marker"], out
    return True


def fake_name(fake_dns, addr, prefix="host"):
    name = f"{prefix}-{secrets.token_hex(4)}.sandbar-test"
    fake_dns.records[name] = addr
    return name


def test_dns_works_in_a_default_sandbox(sandbox, internet, fake_dns):
    name = fake_name(fake_dns, PUBLIC_A)
    assert sandbox.commands.run(resolve_cmd(name), timeout=30).stdout.strip() == PUBLIC_A
    r = sandbox.commands.run(fetch_cmd(url_of(internet, name)), timeout=30)
    assert r.stdout.splitlines()[1] == internet["marker"]


def test_private_destinations_refused_even_when_allowed_by_the_user(make_sandbox, internet):
    for ip in PRIVATE:
        assert httpx.get(url_of(internet, ip), timeout=5).text == internet["marker"]
    default = make_sandbox()
    assert reaches(default, internet, PUBLIC_A)
    allowing = make_sandbox(network={"allow_out": list(PRIVATE), "deny_out": [ALL_TRAFFIC]})
    for sbx in (default, allowing):
        for ip in PRIVATE:
            assert not reaches(sbx, internet, ip), f"a sandbox reached {ip}"


def test_deny_by_ip_and_cidr(make_sandbox, internet):
    sbx = make_sandbox(network={"deny_out": [PUBLIC_A, f"{PUBLIC_B}/31"]})
    assert not reaches(sbx, internet, PUBLIC_A)
    assert not reaches(sbx, internet, PUBLIC_B)  # .22/31 is .22 and .23
    assert not reaches(sbx, internet, PUBLIC_C)
    assert reaches(sbx, internet, PUBLIC_D)


def test_allow_beats_deny(make_sandbox, internet):
    sbx = make_sandbox(network={"allow_out": [f"{PUBLIC_B}/32"], "deny_out": ["192.88.99.0/24"]})
    assert reaches(sbx, internet, PUBLIC_B)
    assert not reaches(sbx, internet, PUBLIC_A)


def test_deny_all_with_one_ip_and_one_domain_allowed(make_sandbox, internet, fake_dns):
    allowed = fake_name(fake_dns, PUBLIC_C, "allowed")
    other = fake_name(fake_dns, PUBLIC_D, "other")
    sbx = make_sandbox(network={"allow_out": [PUBLIC_A, f"*.{allowed}", allowed], "deny_out": [ALL_TRAFFIC]})
    assert reaches(sbx, internet, PUBLIC_A)
    assert not reaches(sbx, internet, PUBLIC_B)
    # The allowed name's address opens only once the sandbox resolved it through its resolver.
    assert not reaches(sbx, internet, PUBLIC_C)
    assert sbx.commands.run(resolve_cmd(allowed), timeout=30).stdout.strip() == PUBLIC_C
    r = sbx.commands.run(fetch_cmd(url_of(internet, allowed)), timeout=30)
    assert r.stdout.splitlines()[1] == internet["marker"]
    # Subdomains match the wildcard.
    sub = f"api.{allowed}"
    fake_dns.records[sub] = PUBLIC_D
    assert reaches(sbx, internet, sub)
    # Other names are not resolved for a closed sandbox (their queries would leave it).
    queries_before = len(fake_dns.queries)
    rc, _, err = run_rc(sbx, resolve_cmd(other), timeout=30)
    assert rc != 0 and "gaierror" in err
    assert other not in fake_dns.queries[queries_before:]


def test_no_internet_access_with_an_allowed_ip(make_sandbox, internet):
    sbx = make_sandbox(allow_internet_access=False, network={"allow_out": [PUBLIC_A]})
    assert reaches(sbx, internet, PUBLIC_A)
    assert not reaches(sbx, internet, PUBLIC_B)


def test_invalid_rules_are_refused(sandbar):
    with pytest.raises(Exception) as refused:
        Sandbox.create(timeout=60, network={"deny_out": ["example.com"]})
    assert "denyOut[0]" in str(refused.value)
    with pytest.raises(Exception) as refused:
        Sandbox.create(timeout=60, network={"allow_out": ["10.0.0.0/33"]})
    assert "10.0.0.0/33" in str(refused.value)


def test_update_network_on_a_running_sandbox(make_sandbox, internet, fake_dns):
    sbx = make_sandbox()
    assert reaches(sbx, internet, PUBLIC_A)
    sbx.update_network({"allow_out": [PUBLIC_B], "deny_out": [ALL_TRAFFIC]})
    assert not reaches(sbx, internet, PUBLIC_A)
    assert reaches(sbx, internet, PUBLIC_B)
    info = sbx.get_info()
    assert info.network["allow_out"] == [PUBLIC_B]
    assert info.network["deny_out"] == [ALL_TRAFFIC]
    # Omitted fields clear: back to open egress.
    sbx.update_network({})
    assert reaches(sbx, internet, PUBLIC_A)
    # Closing it entirely, then opening one domain.
    sbx.update_network({"allow_internet_access": False})
    assert not reaches(sbx, internet, PUBLIC_A)
    name = fake_name(fake_dns, PUBLIC_C, "late")
    sbx.update_network({"allow_out": [name], "deny_out": [ALL_TRAFFIC]})
    assert reaches(sbx, internet, name)
    assert not reaches(sbx, internet, PUBLIC_A)


def test_isolated_sandbox_can_be_opened(make_sandbox, internet):
    sbx = make_sandbox(allow_internet_access=False)
    assert not reaches(sbx, internet, PUBLIC_A)
    sbx.update_network({"allow_out": [PUBLIC_A], "deny_out": [ALL_TRAFFIC]})
    assert reaches(sbx, internet, PUBLIC_A)
    assert not reaches(sbx, internet, PUBLIC_B)


def test_update_network_of_unknown_sandbox(sandbar):
    from e2b import NotFoundException

    with pytest.raises(NotFoundException):
        Sandbox.update_network("iaaaaaaaaaaaaaaaaaaaa", {"deny_out": [ALL_TRAFFIC]})


# A tiny server inside the sandbox that answers with the Host header it received.
HOST_ECHO = r"""python3 - <<'PY'
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.headers.get('Host', '') + '|' + str(self.headers.get('e2b-traffic-access-token'))).encode()
        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(('0.0.0.0', 8000), H).serve_forever()
PY"""


def start_echo(sbx, sandbar):
    sbx.commands.run(HOST_ECHO, background=True)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
    if sbx.traffic_access_token:
        headers["e2b-traffic-access-token"] = sbx.traffic_access_token
    wait_until(
        lambda: httpx.get(sandbar.url + "/", headers=headers, timeout=3).status_code == 200,
        timeout=20,
        message="the echo server in the sandbox",
    )


def test_user_ports_need_the_traffic_token_when_not_public(make_sandbox, sandbar):
    sbx = make_sandbox(network={"allow_public_traffic": False})
    token = sbx.traffic_access_token
    assert token
    start_echo(sbx, sandbar)
    by_header = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
    by_host = {"Host": sbx.get_host(8000)}
    for routing in (by_header, by_host):
        r = httpx.get(sandbar.url + "/", headers=routing, timeout=10)
        assert r.status_code == 403, r.text
        assert r.json()["code"] == 403 and "e2b-traffic-access-token" in r.json()["message"]
        r = httpx.get(sandbar.url + "/", headers={**routing, "e2b-traffic-access-token": "wrong"}, timeout=10)
        assert r.status_code == 403
        r = httpx.get(sandbar.url + "/", headers={**routing, "e2b-traffic-access-token": token}, timeout=10)
        assert r.status_code == 200, r.text
        # The token stops at the edge.
        assert r.text.endswith("|None")
    # The agent port keeps working through the SDK without the traffic token.
    assert sbx.commands.run("echo ok").stdout.strip() == "ok"


def test_public_sandbox_needs_no_token(make_sandbox, sandbar):
    sbx = make_sandbox()
    assert sbx.traffic_access_token is None
    start_echo(sbx, sandbar)
    r = httpx.get(sandbar.url + "/", headers={"Host": sbx.get_host(8000)}, timeout=10)
    assert r.status_code == 200
    assert r.text.split("|")[0] == sbx.get_host(8000)


def test_mask_request_host(make_sandbox, sandbar):
    sbx = make_sandbox(network={"mask_request_host": "${PORT}-masked.example.com"})
    start_echo(sbx, sandbar)
    r = httpx.get(sandbar.url + "/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}, timeout=10)
    assert r.status_code == 200
    assert r.text.split("|")[0] == "8000-masked.example.com"
    info = sbx.get_info()
    assert info.network["mask_request_host"] == "${PORT}-masked.example.com"


def test_rules_survive_a_server_restart(make_sandbox, internet, sandbar, fake_dns):
    name = fake_name(fake_dns, PUBLIC_C, "kept")
    sbx = make_sandbox(timeout=300, network={"allow_out": [PUBLIC_A, name], "deny_out": [ALL_TRAFFIC]})
    open_sbx = make_sandbox(timeout=300)
    assert not reaches(sbx, internet, PUBLIC_B)
    sandbar.restart(kill9=True)
    assert reaches(sbx, internet, PUBLIC_A)
    assert not reaches(sbx, internet, PUBLIC_B)
    assert reaches(sbx, internet, name)
    assert reaches(open_sbx, internet, PUBLIC_B)
