"""What one tenant can do to another, or an outsider to a tenant.

- Traffic the edge or the agent would refuse (no traffic token on a private port, no agent
  token, a signed URL with its user swapped) never wakes a paused sandbox, and the answer to
  traffic that would wake it at the team's limit names nothing of the team.
- A signed file URL is bound to the user it names, and the transfer runs with that user's
  permissions.
About 20 s.
"""

from __future__ import annotations

import json
from typing import List

import httpx
import pytest
from e2b import Sandbox

from e2e_util import sandbar_cli, unique

ENVD_PORT = 49983


@pytest.fixture(scope="module")
def team(sandbar) -> dict:
    """A team of its own with room for two sandboxes at once."""
    made = json.loads(sandbar_cli(sandbar, "team", "create", unique("tenancy")))
    sandbar_cli(sandbar, "team", "set-limits", made["teamID"], "--max-sandboxes", "2")
    return made


@pytest.fixture
def team_sandboxes(sandbar, team):
    made: List[Sandbox] = []
    yield made
    for sbx in made:
        httpx.delete(f"{sandbar.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": team["apiKey"]}, timeout=30)


def _edge(sandbar, sandbox_id: str, port: int, path: str = "/", headers=None) -> httpx.Response:
    routing = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port), **(headers or {})}
    return httpx.get(sandbar.url + path, headers=routing, timeout=30)


def _state(sandbar, team, sandbox_id: str) -> str:
    r = httpx.get(f"{sandbar.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": team["apiKey"]}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["state"]


def test_refused_traffic_never_wakes_a_paused_sandbox(sandbar, team, team_sandboxes):
    key = team["apiKey"]
    sbx = Sandbox.create(
        api_key=key, timeout=120,
        lifecycle={"on_timeout": "pause", "auto_resume": True},
        network={"allow_public_traffic": False},
    )
    team_sandboxes.append(sbx)
    traffic_token = sbx.traffic_access_token
    assert traffic_token
    signed_for_user = sbx.download_url("/etc/hostname", user="user")
    assert sbx.pause()
    assert _state(sandbar, team, sbx.sandbox_id) == "paused"

    refused = [
        _edge(sandbar, sbx.sandbox_id, 8000),
        _edge(sandbar, sbx.sandbox_id, 8000, headers={"e2b-traffic-access-token": "guessed"}),
        _edge(sandbar, sbx.sandbox_id, ENVD_PORT, "/health"),
        _edge(sandbar, sbx.sandbox_id, ENVD_PORT, "/health", headers={"X-Access-Token": "guessed"}),
        _edge(sandbar, sbx.sandbox_id, ENVD_PORT, "/files?" + signed_for_user.split("?", 1)[1].replace("username=user", "username=root")),
    ]
    assert [r.status_code for r in refused] == [403, 403, 502, 502, 502], [r.text for r in refused]
    for r in refused:
        assert team["teamID"] not in r.text and "limit" not in r.text, r.text
    assert _state(sandbar, team, sbx.sandbox_id) == "paused"

    # At the team's limit, traffic that would be let through is refused without naming it.
    others = [Sandbox.create(api_key=key, timeout=120) for _ in range(2)]
    team_sandboxes.extend(others)
    busy = _edge(sandbar, sbx.sandbox_id, 8000, headers={"e2b-traffic-access-token": traffic_token})
    assert busy.status_code == 429, busy.text
    assert "team" not in busy.text and "limit" not in busy.text, busy.text
    assert int(busy.headers["retry-after"]) > 0
    assert _state(sandbar, team, sbx.sandbox_id) == "paused"

    # With a slot free, the token wakes it (nothing listens on the port, but it runs).
    others[0].kill()
    woken = _edge(sandbar, sbx.sandbox_id, 8000, headers={"e2b-traffic-access-token": traffic_token})
    assert woken.status_code == 502, woken.text
    assert _state(sandbar, team, sbx.sandbox_id) == "running"


def test_a_signed_url_is_bound_to_its_user_and_runs_with_its_permissions(sandbar, sandbox):
    sandbox.files.write("/home/user/mine.txt", "for user")
    url = sandbox.download_url("/home/user/mine.txt", user="user")
    assert httpx.get(url, timeout=30).content == b"for user"
    for other in ("root", "nobody"):
        swapped = httpx.get(url.replace("username=user", f"username={other}"), timeout=30)
        assert swapped.status_code == 401, f"{other}: {swapped.status_code} {swapped.text}"
    # Without a user the SDK signs '' and the agent picks the default user: adding one breaks it.
    default = sandbox.download_url("/home/user/mine.txt")
    assert "username=" not in default
    assert httpx.get(default, timeout=30).status_code == 200
    assert httpx.get(default + "&username=root", timeout=30).status_code == 401

    # The user's permissions, not the agent's.
    shadow = httpx.get(sandbox.download_url("/etc/shadow", user="user"), timeout=30)
    assert shadow.status_code in (401, 403), f"{shadow.status_code} {shadow.text}"
    assert "root:" not in shadow.text
    as_root = httpx.get(sandbox.download_url("/etc/shadow", user="root"), timeout=30)
    assert as_root.status_code == 200 and b"root:" in as_root.content

    upload = sandbox.upload_url("/etc/planted", user="user")
    r = httpx.post(upload, files={"file": ("planted", b"x")}, timeout=30)
    assert r.status_code in (401, 403), f"{r.status_code} {r.text}"
    exists = sandbox.commands.run("test -e /etc/planted && echo yes || echo no", user="root").stdout.strip()
    assert exists == "no"

    upload = sandbox.upload_url("/home/user/new/dir/file.txt", user="user")
    r = httpx.post(upload, files={"file": ("file.txt", b"mine")}, timeout=30)
    assert r.status_code == 200, r.text
    owners = sandbox.commands.run("stat -c %U /home/user/new /home/user/new/dir /home/user/new/dir/file.txt").stdout.split()
    assert owners == ["user", "user", "user"], owners


def test_an_oversized_body_is_413_naming_the_limit(sandbar):
    body = b'{"templateID": "base", "metadata": {"k": "' + b"x" * (50 << 20) + b'"}}'
    with sandbar.client(timeout=60) as api:
        r = api.post("/sandboxes", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert "2 MiB" in r.json()["message"], r.text


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("metadata", {f"k{i}": "v" for i in range(33)}, "limit of 32"),
        ("metadata", {"k": "v" * 1025}, "limit of 1024"),
        ("metadata", {"k" * 129: "v"}, "128 bytes"),
        ("envVars", {"A B": "1"}, "environment variable name"),
        ("envVars", {"A\nB": "1"}, "environment variable name"),
        ("envVars", {"A=B": "1"}, "environment variable name"),
    ],
)
def test_metadata_and_env_limits_are_400_naming_them(sandbar, field, value, named):
    with sandbar.client() as api:
        r = api.post("/sandboxes", json={"templateID": "base", field: value})
    assert r.status_code == 400, r.text
    assert named in r.json()["message"], r.text


@pytest.fixture(scope="module")
def rival(sandbar) -> dict:
    """A second team, to hold the same names as the first."""
    return json.loads(sandbar_cli(sandbar, "team", "create", unique("rival")))


def test_names_are_per_team_and_what_another_team_keeps_private_is_not_found(sandbar, team, rival, team_sandboxes):
    from e2b import Template

    name = unique("shared-name")
    made = {}
    for owner in (team, rival):
        headers = {"X-API-Key": owner["apiKey"]}
        build = Template.build(Template().from_template("base").run_cmd(f"echo {owner['slug']} > /tmp/owner"),
                               f"{name}:v1", api_key=owner["apiKey"])
        assert build.template_id
        sbx = Sandbox.create(api_key=owner["apiKey"], timeout=60)
        r = httpx.post(f"{sandbar.url}/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": f"{name}-snap"},
                       headers=headers, timeout=120)
        assert r.status_code in (200, 201), r.text
        assert r.json()["snapshotID"] == f"{owner['slug']}/{name}-snap:default", r.text
        httpx.delete(f"{sandbar.url}/sandboxes/{sbx.sandbox_id}", headers=headers, timeout=30)
        made[owner["teamID"]] = {"template": build.template_id, "snapshot": r.json()}

    mine, theirs = team, rival
    mine_h, theirs_h = {"X-API-Key": mine["apiKey"]}, {"X-API-Key": theirs["apiKey"]}
    theirs_template = made[theirs["teamID"]]["template"]
    with httpx.Client(base_url=sandbar.url, timeout=60) as api:
        # The same template name in two teams; each sees its own, named in its namespace.
        detail = api.get(f"/templates/{made[mine['teamID']]['template']}", headers=mine_h)
        assert detail.status_code == 200, detail.text
        assert f"{mine['slug']}/{name}" in detail.json()["names"], detail.text
        assert detail.json()["aliases"] == [name]

        # Another team's private template and snapshot: by ID, by name, namespaced or not,
        # answered like something that does not exist.
        for reference in (theirs_template, f"{theirs['slug']}/{name}", f"{theirs['slug']}/{name}:v1",
                          f"{theirs['slug']}/{name}-snap:default", made[theirs["teamID"]]["snapshot"]["snapshotID"]):
            r = api.get(f"/templates/{reference.replace('/', '%2F').replace(':', '%3A')}", headers=mine_h)
            assert r.status_code == 404, f"{reference}: {r.status_code} {r.text}"
            r = api.post("/sandboxes", json={"templateID": reference}, headers=mine_h)
            assert r.status_code == 404, f"{reference}: {r.status_code} {r.text}"
            assert theirs["slug"] not in r.json()["message"] or reference in r.json()["message"]
        assert api.get(f"/templates/aliases/{theirs['slug']}%2F{name}", headers=mine_h).status_code == 404
        assert api.delete(f"/templates/{theirs_template}", headers=mine_h).status_code == 404
        volume = api.post("/volumes", json={"name": name}, headers=theirs_h)
        assert volume.status_code in (200, 201), volume.text
        assert api.get(f"/volumes/{volume.json()['volumeID']}", headers=mine_h).status_code == 404
        assert api.delete(f"/volumes/{volume.json()['volumeID']}", headers=theirs_h).status_code == 204

    # The SDK resolves the bare name and the namespaced one with a tag to the team's own.
    for reference in (name, f"{name}:v1", f"{mine['slug']}/{name}:v1"):
        sbx = Sandbox.create(template=reference, api_key=mine["apiKey"], timeout=60)
        try:
            assert sbx.commands.run("cat /tmp/owner").stdout.strip() == mine["slug"], reference
        finally:
            sbx.kill()
    snap = Sandbox.create(template=f"{mine['slug']}/{name}-snap", api_key=mine["apiKey"], timeout=60)
    snap.kill()
    for owner in (team, rival):
        headers = {"X-API-Key": owner["apiKey"]}
        httpx.delete(f"{sandbar.url}/templates/{made[owner['teamID']]['template']}", headers=headers, timeout=30)
        snapshot_template = made[owner["teamID"]]["snapshot"]["snapshotID"]
        httpx.delete(f"{sandbar.url}/templates/{snapshot_template.replace('/', '%2F').replace(':', '%3A')}",
                     headers=headers, timeout=30)
