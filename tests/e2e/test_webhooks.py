"""Webhooks at /events/webhooks, as E2B offers them: a receiver this test runs on 127.0.0.1
gets the lifecycle events it asked for, in order, each signed as E2B signs (`e2b-signature`,
unpadded base64 SHA-256 of the secret and the body), and a delivery it answers with 500 is
tried again (the suite's server waits 1 s between attempts, E2B's 10) and logged; a disabled
or deleted webhook gets nothing more; another team sees none; bad bodies are refused."""

import base64
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from e2b import Sandbox

from e2e_util import sandbar_cli, unique

CREATED = "sandbox.lifecycle.created"
PAUSED = "sandbox.lifecycle.paused"
KILLED = "sandbox.lifecycle.killed"
SECRET = "receiver-secret-" + "x" * 16


class Receiver:
    """An HTTP server on 127.0.0.1 that keeps every request and fails the first one."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_first = True
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.requests.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                failing = received.fail_first
                received.fail_first = False
                self.send_response(500 if failing else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def events(self, sandbox_id: str) -> list[tuple[dict, dict]]:
        out = []
        for r in list(self.requests):
            event = json.loads(r["body"])
            if event["sandboxId"] == sandbox_id:
                out.append((r, event))
        return out


def _api(sandbar, method: str, path: str, key: str | None = None, **kwargs) -> httpx.Response:
    return httpx.request(
        method, f"{sandbar.url}{path}", headers={"X-API-Key": key or sandbar.api_key}, timeout=30, **kwargs
    )


def _signature(body: bytes) -> str:
    return base64.b64encode(hashlib.sha256(SECRET.encode() + body).digest()).decode().rstrip("=")


def test_signed_deliveries_in_order_with_a_retry(sandbar):
    receiver = Receiver()
    created = _api(
        sandbar,
        "POST",
        "/events/webhooks",
        json={
            "name": unique("hook"),
            "url": receiver.url,
            "enabled": True,
            "events": [CREATED, PAUSED, KILLED],
            "signatureSecret": SECRET,
        },
    )
    assert created.status_code == 201, created.text
    hook = created.json()
    assert "signatureSecret" not in hook and hook["enabled"] is True
    try:
        sbx = Sandbox.create(timeout=120)
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id)
        sbx.kill()
        deadline = time.monotonic() + 30
        while len(receiver.events(sbx.sandbox_id)) < 4:
            assert time.monotonic() < deadline, receiver.requests
            time.sleep(0.1)
        time.sleep(0.5)
        got = receiver.events(sbx.sandbox_id)
        # The first answer was 500: `created` came twice, with one delivery id; the resume
        # was not asked for.
        assert [e["type"] for _, e in got] == [CREATED, CREATED, PAUSED, KILLED]
        assert got[0][0]["headers"]["e2b-delivery-id"] == got[1][0]["headers"]["e2b-delivery-id"]
        assert got[1][0]["headers"]["e2b-delivery-id"] != got[2][0]["headers"]["e2b-delivery-id"]
        for request, event in got:
            headers = request["headers"]
            assert headers["e2b-webhook-id"] == hook["id"]
            assert headers["e2b-signature-version"] == "v1"
            assert headers["e2b-signature"] == _signature(request["body"])
            assert headers["content-type"] == "application/json"
            assert event["version"] == "v2" and event["sandboxTeamId"] == hook["teamID"]
        # The same events the API serves.
        served = _api(sandbar, "GET", f"/events/sandboxes/{sbx.sandbox_id}", params={"orderAsc": "true"}).json()
        assert [e["id"] for e in served if e["type"] in (CREATED, PAUSED, KILLED)] == [e["id"] for _, e in got[1:]]

        # The delivery log has every attempt, the failed one with its status.
        log = _api(sandbar, "GET", f"/events/webhooks/{hook['id']}/deliveries").json()
        mine = [d for d in log if d["eventId"] in {e["id"] for _, e in got}]
        assert sorted((d["eventType"], d["attempt"], d["statusCode"], d["delivered"]) for d in mine) == sorted(
            [(CREATED, 1, 500, False), (CREATED, 2, 200, True), (PAUSED, 1, 200, True), (KILLED, 1, 200, True)]
        )

        # Disabled: nothing more. Deleted: gone.
        patched = _api(sandbar, "PATCH", f"/events/webhooks/{hook['id']}", json={"enabled": False})
        assert patched.status_code == 200 and patched.json()["enabled"] is False
        quiet = Sandbox.create(timeout=60)
        quiet.kill()
        time.sleep(2)
        assert receiver.events(quiet.sandbox_id) == []
        assert _api(sandbar, "DELETE", f"/events/webhooks/{hook['id']}").status_code == 200
        assert _api(sandbar, "GET", f"/events/webhooks/{hook['id']}").status_code == 404
        hook = None
    finally:
        if hook:
            _api(sandbar, "DELETE", f"/events/webhooks/{hook['id']}")
        receiver.close()


def test_webhooks_are_the_teams_own_and_bad_bodies_are_refused(sandbar):
    body = {"name": unique("hook"), "url": "http://127.0.0.1:9/hook", "events": [KILLED], "signatureSecret": SECRET}
    hook = _api(sandbar, "POST", "/events/webhooks", json=body).json()
    other = json.loads(sandbar_cli(sandbar, "team", "create", unique("hookteam")))
    try:
        assert _api(sandbar, "GET", f"/events/webhooks/{hook['id']}", key=other["apiKey"]).status_code == 404
        assert _api(sandbar, "DELETE", f"/events/webhooks/{hook['id']}", key=other["apiKey"]).status_code == 404
        assert _api(sandbar, "GET", "/events/webhooks", key=other["apiKey"]).json() == []
        listed = _api(sandbar, "GET", "/events/webhooks").json()
        assert hook["id"] in [h["id"] for h in listed]

        for change, words in (
            ({"url": "ftp://127.0.0.1/hook"}, "http or https"),
            ({"url": "http://user:pw@127.0.0.1/hook"}, "credentials"),
            ({"url": "not a url"}, "invalid url"),
            ({"events": ["sandbox.lifecycle.exploded"]}, "unknown event type"),
            ({"events": []}, "at least one"),
            ({"signatureSecret": "short"}, "signatureSecret"),
            ({"name": ""}, "name"),
            ({"colour": "blue"}, "unknown field"),
        ):
            reply = _api(sandbar, "POST", "/events/webhooks", json={**body, **change})
            assert reply.status_code == 400, (change, reply.text)
            assert reply.json()["code"] == 400 and words in reply.json()["message"], (change, reply.json())
        reply = _api(sandbar, "POST", "/events/webhooks", json={"url": "http://127.0.0.1:9/"})
        assert reply.status_code == 400 and "required" in reply.json()["message"]

        # A team holds ten at most.
        made = [
            _api(sandbar, "POST", "/events/webhooks", key=other["apiKey"], json={**body, "name": f"h{i}"})
            for i in range(11)
        ]
        assert [r.status_code for r in made] == [201] * 10 + [429], [r.text for r in made]
        assert "limit of 10 webhooks" in made[-1].json()["message"]
    finally:
        _api(sandbar, "DELETE", f"/events/webhooks/{hook['id']}")
