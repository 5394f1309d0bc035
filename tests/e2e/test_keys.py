"""API keys, access tokens, teams and per-team limits on a running server: keys made through
the API and with the operator's `sandbar team`/`sandbar key` commands, used by the SDK."""

import json

import httpx
import pytest
from e2b import AuthenticationException, Sandbox

from e2e_util import sandbar_cli, unique


def _access_token(sandbar) -> str:
    return json.loads((sandbar.data_dir / "credentials.json").read_text())["accessToken"]


def _kill(sandbar, sandbox_id: str, api_key: str) -> None:
    httpx.delete(f"{sandbar.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": api_key}, timeout=30)


def test_api_key_made_through_the_api_works_until_deleted(sandbar):
    bearer = {"Authorization": f"Bearer {_access_token(sandbar)}"}
    name = unique("key")
    reply = httpx.post(f"{sandbar.url}/api-keys", headers=bearer, json={"name": name}, timeout=30)
    assert reply.status_code == 201, reply.text
    created = reply.json()
    key, key_id = created["key"], created["id"]
    assert key.startswith("e2b_") and created["mask"]["maskedValueSuffix"] == key[-4:]

    sbx = Sandbox.create(api_key=key, timeout=60)
    try:
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        sbx.kill()

    listed = httpx.get(f"{sandbar.url}/api-keys", headers=bearer, timeout=30).json()
    mine = [k for k in listed if k["id"] == key_id]
    assert len(mine) == 1 and mine[0]["name"] == name
    assert mine[0]["lastUsed"] is not None
    assert key not in json.dumps(listed)

    reply = httpx.delete(f"{sandbar.url}/api-keys/{key_id}", headers=bearer, timeout=30)
    assert reply.status_code == 204, reply.text
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key=key, timeout=60)
    # The suite's own key is untouched.
    assert httpx.get(f"{sandbar.url}/v2/sandboxes", headers={"X-API-Key": sandbar.api_key}, timeout=30).status_code == 200


def test_cli_team_is_isolated_limited_and_revocable_while_serving(sandbar, sandbox, track_sandbox_id):
    name = unique("team")
    team = json.loads(sandbar_cli(sandbar, "team", "create", name))
    assert team["apiKey"].startswith("e2b_") and team["accessToken"].startswith("sk_e2b_")
    assert team["teamID"] in sandbar_cli(sandbar, "team", "list")
    made = json.loads(sandbar_cli(sandbar, "key", "create", team["teamID"], "--name", "cli-e2e"))
    key = made["key"]
    assert made["id"] in sandbar_cli(sandbar, "key", "list", name)
    headers = {"X-API-Key": key}

    # The new team's key works and sees nothing of the first team's.
    other = Sandbox.create(api_key=key, timeout=60)
    try:
        reply = httpx.get(f"{sandbar.url}/sandboxes/{sandbox.sandbox_id}", headers=headers, timeout=30)
        assert reply.status_code == 404, reply.text
        assert reply.json()["code"] == 404
        listed = httpx.get(f"{sandbar.url}/v2/sandboxes", headers=headers, timeout=30).json()
        assert [s["sandboxID"] for s in listed] == [other.sandbox_id]
        reply = httpx.delete(f"{sandbar.url}/sandboxes/{sandbox.sandbox_id}", headers=headers, timeout=30)
        assert reply.status_code == 404
        assert sandbox.is_running()

        # A limit set by the operator applies to the running server's next request.
        sandbar_cli(sandbar, "team", "set-limits", team["teamID"], "--max-sandboxes", "1")
        reply = httpx.post(
            f"{sandbar.url}/sandboxes", headers=headers, json={"templateID": "base", "timeout": 60}, timeout=60
        )
        if reply.status_code == 201:
            track_sandbox_id(reply.json()["sandboxID"])
        assert reply.status_code == 429, reply.text
        assert reply.json()["code"] == 429 and "1 concurrent" in reply.json()["message"]
        assert 1 <= int(reply.headers["Retry-After"]) <= 60
    finally:
        _kill(sandbar, other.sandbox_id, key)

    # So does a revoked key.
    sandbar_cli(sandbar, "key", "revoke", made["id"])
    reply = httpx.get(f"{sandbar.url}/v2/sandboxes", headers=headers, timeout=30)
    assert reply.status_code == 401, reply.text
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key=key, timeout=60)
    assert httpx.get(f"{sandbar.url}/v2/sandboxes", headers={"X-API-Key": team["apiKey"]}, timeout=30).status_code == 200
