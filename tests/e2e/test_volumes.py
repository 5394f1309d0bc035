"""Persistent volumes through the official SDK: the control plane, mounts shared by sandboxes
that run as different host id ranges, the volume content API (with E2B_VOLUME_API_URL set to
the server), symlinks planted by a sandbox, and data that outlives a server restart."""

import hashlib
import os
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import NotFoundException, VolumeException

from e2e_util import DATA_DIR, destroy_volume, unique


@pytest.fixture
def volume_api(sandbar, monkeypatch):
    monkeypatch.setenv("E2B_VOLUME_API_URL", sandbar.url)
    return sandbar


@pytest.fixture
def make_volume(sandbar):
    made = []

    def _make(prefix="vol"):
        vol = Volume.create(unique(prefix))
        made.append(vol)
        return vol

    try:
        yield _make
    finally:
        for vol in made:
            try:
                destroy_volume(sandbar.url, sandbar.api_key, vol.volume_id, vol.name)
            except Exception:  # noqa: BLE001 - teardown must not mask the test result
                pass


def _api(sandbar, method, path, **kw):
    headers = kw.pop("headers", {})
    headers.setdefault("X-API-Key", sandbar.api_key)
    return httpx.request(method, f"{sandbar.url}{path}", headers=headers, timeout=30, **kw)


def _host_uid_base(sbx):
    # "0 <host base> 65536": which host range the sandbox's ids stand for.
    line = sbx.commands.run("cat /proc/self/uid_map", user="root").stdout.split()
    return int(line[1])


def _volume_dirs():
    root = DATA_DIR / "sandboxes" / ".volumes"
    return {p.name: p for team in root.iterdir() if not team.name.startswith(".") for p in team.iterdir()}


def test_control_plane(sandbar, make_volume):
    vol = make_volume()
    assert vol.token and vol.token.startswith("vol_")
    listed = {v.volume_id: v.name for v in Volume.list()}
    assert listed[vol.volume_id] == vol.name
    info = Volume.get_info(vol.volume_id)
    assert (info.volume_id, info.name, info.token) == (vol.volume_id, vol.name, vol.token)

    r = _api(sandbar, "POST", "/volumes", json={"name": vol.name})
    assert r.status_code == 409, r.text
    assert vol.name in r.json()["message"]
    for bad in ["", "has space", "a/b", "../x", "x" * 129]:
        r = _api(sandbar, "POST", "/volumes", json={"name": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["code"] == 400
    r = _api(sandbar, "POST", "/volumes", json={})
    assert r.status_code == 400
    r = _api(sandbar, "GET", "/volumes/nope")
    assert r.status_code == 404 and "nope" in r.json()["message"]
    r = _api(sandbar, "GET", "/volumes", headers={"X-API-Key": "e2b_" + "0" * 40})
    assert r.status_code == 401
    assert len([v for v in Volume.list() if v.name == vol.name]) == 1

    other = make_volume()
    assert Volume.destroy(other.volume_id) is True
    assert Volume.destroy(other.volume_id) is False
    assert other.volume_id not in _volume_dirs()


def test_mounted_volume_is_shared_across_slots_and_survives_kill(sandbar, make_sandbox, make_volume, volume_api):
    vol = make_volume()
    a = make_sandbox(volume_mounts={"/mnt/vol": vol})
    assert a.get_info().volume_mounts == [{"name": vol.name, "path": "/mnt/vol"}]
    a.commands.run("echo from-user > /mnt/vol/user.txt && mkdir /mnt/vol/udir", user="user")
    a.commands.run("echo from-root > /mnt/vol/root.txt", user="root")
    owners = a.commands.run("stat -c '%n %u %g' /mnt/vol/user.txt /mnt/vol/root.txt", user="root").stdout
    assert owners.split("\n")[:2] == ["/mnt/vol/user.txt 1000 1000", "/mnt/vol/root.txt 0 0"]
    base_a = _host_uid_base(a)

    # A mounted volume cannot be deleted.
    r = _api(sandbar, "DELETE", f"/volumes/{vol.volume_id}")
    assert r.status_code == 409, r.text
    assert a.sandbox_id in r.json()["message"]
    with pytest.raises(VolumeException):
        Volume.destroy(vol.volume_id)
    assert a.commands.run("cat /mnt/vol/user.txt").stdout == "from-user\n"

    a.kill()
    # The next sandbox takes A's slot, so B runs as another host range.
    filler = make_sandbox()
    b = make_sandbox(volume_mounts={"/data/shared": vol.name})
    base_b = _host_uid_base(b)
    if base_b == base_a:
        b = make_sandbox(volume_mounts={"/data/shared": vol.name})
        base_b = _host_uid_base(b)
    assert base_b != base_a
    filler.kill()

    assert b.commands.run("cat /data/shared/user.txt /data/shared/root.txt", user="user").stdout == (
        "from-user\nfrom-root\n"
    )
    b.commands.run("echo more-user >> /data/shared/user.txt && touch /data/shared/udir/f", user="user")
    b.commands.run("echo more-root >> /data/shared/root.txt", user="root")
    assert vol.read_file("/user.txt") == "from-user\nmore-user\n"
    assert vol.read_file("/root.txt") == "from-root\nmore-root\n"
    assert (vol.get_info("/udir/f").uid, vol.get_info("/user.txt").uid) == (1000, 1000)


def test_paused_sandbox_keeps_its_volume(sandbar, make_sandbox, make_volume, volume_api):
    vol = make_volume()
    sbx = make_sandbox(volume_mounts={"/mnt/v": vol})
    sbx.commands.run("echo kept > /mnt/v/f", user="user")
    sbx.pause()
    r = _api(sandbar, "DELETE", f"/volumes/{vol.volume_id}")
    assert r.status_code == 409, r.text
    assert vol.read_file("/f") == "kept\n"
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.commands.run("cat /mnt/v/f").stdout == "kept\n"


def test_user_cannot_write_roots_file(make_sandbox, make_volume):
    vol = make_volume()
    sbx = make_sandbox(volume_mounts={"/mnt/v": vol})
    sbx.commands.run("echo r > /mnt/v/root.txt", user="root")
    from e2b import CommandExitException

    with pytest.raises(CommandExitException):
        sbx.commands.run("echo x >> /mnt/v/root.txt", user="user")
    assert sbx.commands.run("cat /mnt/v/root.txt").stdout == "r\n"


def test_content_api(sandbar, make_volume, make_sandbox, volume_api):
    vol = make_volume()
    entry = vol.write_file("/docs/readme.txt", "hello volume", force=True)
    assert (entry.name, entry.size, entry.path) == ("readme.txt", 12, "/docs/readme.txt")
    assert vol.read_file("docs/readme.txt") == "hello volume"
    assert vol.read_file("/docs/readme.txt", format="bytes") == b"hello volume"
    vol.write_file("/docs/readme.txt", "replaced")
    assert vol.read_file("/docs/readme.txt") == "replaced"
    vol.write_file("/owned.txt", b"mine", uid=1000, gid=1000, mode=0o600)
    info = vol.get_info("/owned.txt")
    assert (info.uid, info.gid, info.mode) == (1000, 1000, 0o600)
    d = vol.make_dir("/a/b/c", force=True)
    assert d.type.value == "directory"
    names = sorted(e.path for e in vol.list("/", depth=3))
    assert names == ["/a", "/a/b", "/a/b/c", "/docs", "/docs/readme.txt", "/owned.txt"]
    assert vol.exists("/a/b") and not vol.exists("/nope")
    updated = vol.update_metadata("/owned.txt", mode=0o640)
    assert updated.mode == 0o640

    # What the API wrote is what a sandbox sees, owners included.
    sbx = make_sandbox(volume_mounts={"/vol": vol})
    assert sbx.commands.run("cat /vol/owned.txt", user="user").stdout == "mine"
    sbx.commands.run("echo from-sandbox > /vol/a/b/c/new.txt", user="root")
    assert vol.read_file("/a/b/c/new.txt") == "from-sandbox\n"

    vol.remove("/a")
    assert not vol.exists("/a")
    assert sbx.commands.run("ls /vol").stdout.split() == ["docs", "owned.txt"]
    with pytest.raises(NotFoundException):
        vol.read_file("/a/b/c/new.txt")
    with pytest.raises(NotFoundException):
        vol.remove("/a")

    # Errors: token, paths, parameters.
    base = f"{sandbar.url}/volumecontent/{vol.volume_id}"
    r = httpx.get(f"{base}/file", params={"path": "/owned.txt"})
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.get(
        f"{base}/file", params={"path": "/owned.txt"}, headers={"Authorization": "Bearer vol_" + "0" * 64}
    )
    assert r.status_code == 401
    other = make_volume()
    r = httpx.get(
        f"{sandbar.url}/volumecontent/{other.volume_id}/file",
        params={"path": "/owned.txt"},
        headers={"Authorization": f"Bearer {vol.token}"},
    )
    assert r.status_code == 401, "one volume's token opens another volume"
    auth = {"Authorization": f"Bearer {vol.token}"}
    for path in ["../x", "/docs/../../x", "a/../../../etc/passwd"]:
        r = httpx.get(f"{base}/file", params={"path": path}, headers=auth)
        assert r.status_code == 400 and ".." in r.json()["message"], (path, r.text)
    r = httpx.get(f"{base}/file", headers=auth)
    assert r.status_code == 400 and "path" in r.json()["message"]
    r = httpx.put(f"{base}/file", params={"path": "/x", "uid": "70000"}, headers=auth, content=b"x")
    assert r.status_code == 400 and "70000" in r.json()["message"]
    r = httpx.put(f"{base}/file", params={"path": "/x", "mode": str(0o4755)}, headers=auth, content=b"x")
    assert r.status_code == 400
    r = httpx.put(f"{base}/file", params={"path": "/"}, headers=auth, content=b"x")
    assert r.status_code == 400
    r = httpx.delete(f"{base}/path", params={"path": "/"}, headers=auth)
    assert r.status_code == 400
    r = httpx.post(f"{base}/dir", params={"path": "/docs"}, headers=auth)
    assert r.status_code == 409
    r = httpx.put(f"{base}/file", params={"path": "/missing/dir/f"}, headers=auth, content=b"x")
    assert r.status_code == 404
    assert not vol.exists("/x")


def test_planted_symlinks_never_lead_out(sandbar, make_volume, make_sandbox, volume_api):
    vol = make_volume()
    neighbour = make_volume("neighbour")
    neighbour.write_file("/secret.txt", "neighbour data")
    sbx = make_sandbox(volume_mounts={"/mnt/vol": vol})
    sbx.commands.run(
        "cd /mnt/vol && ln -s /etc/shadow shadow && ln -s .. up && ln -s / rootlink "
        "&& ln -s ../../.. far && mkdir d && ln -s ../up d/up2",
        user="root",
    )
    shadow = Path("/etc/shadow").read_bytes()
    shadow_sum = hashlib.sha256(shadow).hexdigest()
    auth = {"Authorization": f"Bearer {vol.token}"}
    base = f"{sandbar.url}/volumecontent/{vol.volume_id}"

    # The content API reports links without following them.
    entries = {e.name: e for e in vol.list("/")}
    assert entries["shadow"].type.value == "symlink"
    assert getattr(entries["shadow"], "target", None) in (None, "/etc/shadow")

    for path in ["/shadow", "/up/" + neighbour.volume_id + "/secret.txt", "/rootlink/etc/shadow",
                 "/far/etc/shadow", "/d/up2/x"]:
        r = httpx.get(f"{base}/file", params={"path": path}, headers=auth)
        assert r.status_code in (400, 404), (path, r.status_code, r.text)
        assert shadow not in r.content and b"neighbour data" not in r.content
    for path in ["/up", "/rootlink", "/far/etc"]:
        r = httpx.get(f"{base}/dir", params={"path": path}, headers=auth)
        assert r.status_code in (400, 404), (path, r.text)
        assert neighbour.volume_id not in r.text and "shadow" not in r.text
    r = httpx.get(f"{base}/file", params={"path": "/shadow"}, headers=auth)
    assert "outside the volume" in r.json()["message"]

    # Writes never go through a link: the link itself is replaced, or the write is refused.
    r = httpx.put(f"{base}/file", params={"path": "/up/escaped.txt"}, headers=auth, content=b"x")
    assert r.status_code == 400, r.text
    r = httpx.put(f"{base}/file", params={"path": "/rootlink/tmp/escaped.txt", "force": "true"},
                  headers=auth, content=b"x")
    assert r.status_code == 400, r.text
    r = httpx.post(f"{base}/dir", params={"path": "/up/newdir", "force": "true"}, headers=auth)
    assert r.status_code == 400, r.text
    r = httpx.patch(f"{base}/path", params={"path": "/shadow"}, headers=auth, json={"mode": 0o777})
    assert r.status_code == 400, r.text
    vol.write_file("/shadow", "replaced the link")
    assert hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest() == shadow_sum
    assert vol.get_info("/shadow").type.value == "file"
    assert not Path("/tmp/escaped.txt").exists()
    dirs = _volume_dirs()
    assert not (dirs[vol.volume_id].parent / "escaped.txt").exists()
    assert not (dirs[vol.volume_id].parent / "newdir").exists()
    # Removing a link removes the link, not its target.
    vol.remove("/up")
    vol.remove("/rootlink")
    assert dirs[neighbour.volume_id].is_dir() and Path("/etc/shadow").exists()
    assert neighbour.read_file("/secret.txt") == "neighbour data"

    # Inside the sandbox, the same links resolve inside the sandbox's own root.
    sbx.commands.run("ln -s .. /mnt/vol/up", user="root")
    listing = sbx.commands.run("ls -a /mnt/vol/up/ /mnt/vol/../", user="root").stdout
    assert neighbour.volume_id not in listing and "vol" in listing
    mountinfo = sbx.commands.run("cat /proc/self/mountinfo").stdout
    # The mount's root is its path inside the disk pool, never a host path.
    assert str(DATA_DIR) not in mountinfo and "/var/" not in mountinfo
    assert sbx.commands.run("cat /mnt/vol/far/etc/hostname").stdout.strip() == "e2b.local"


def test_bad_mounts_are_refused(sandbar, make_volume):
    vol = make_volume()
    base = {"templateID": "base", "timeout": 30}
    cases = [
        ([{"name": vol.name, "path": "relative"}], "volumeMounts[0]"),
        ([{"name": vol.name, "path": "/"}], "volumeMounts[0]"),
        ([{"name": vol.name, "path": "/proc/x"}], "/proc"),
        ([{"name": vol.name, "path": "/sys"}], "/sys"),
        ([{"name": vol.name, "path": "/dev/v"}], "/dev"),
        ([{"name": vol.name, "path": "/a/../b"}], ".."),
        ([{"name": vol.name, "path": "/a"}, {"name": vol.name, "path": "/a/"}], "volumeMounts[1]"),
        ([{"name": "no-such-volume", "path": "/a"}], "no-such-volume"),
        ([{"name": vol.name}], "volumeMounts[0]: path"),
        ([{"name": 5, "path": "/a"}], "volumeMounts[0]: name"),
    ]
    before = {s["sandboxID"] for s in _api(sandbar, "GET", "/v2/sandboxes").json()}
    for mounts, needle in cases:
        r = _api(sandbar, "POST", "/v2/sandboxes", json={**base, "volumeMounts": mounts})
        assert r.status_code == 400, (mounts, r.text)
        assert needle in r.json()["message"], (mounts, r.json())
    after = {s["sandboxID"] for s in _api(sandbar, "GET", "/v2/sandboxes").json()}
    assert after == before


def test_volume_data_survives_restart(sandbar, make_volume, make_sandbox, volume_api):
    vol = make_volume()
    vol.write_file("/kept.txt", "before restart")
    running = make_sandbox(volume_mounts={"/mnt/vol": vol})
    running.commands.run("echo from-sandbox > /mnt/vol/sbx.txt", user="user")

    sandbar.restart(kill9=True)

    assert Volume.get_info(vol.volume_id).token == vol.token
    assert vol.read_file("/kept.txt") == "before restart"
    assert vol.read_file("/sbx.txt") == "from-sandbox\n"
    # The adopted sandbox still has its mount, and still blocks deletion.
    assert running.commands.run("cat /mnt/vol/kept.txt").stdout == "before restart"
    assert running.get_info().volume_mounts == [{"name": vol.name, "path": "/mnt/vol"}]
    assert _api(sandbar, "DELETE", f"/volumes/{vol.volume_id}").status_code == 409
    running.kill()
    fresh = make_sandbox(volume_mounts={"/mnt/vol": vol})
    assert fresh.commands.run("cat /mnt/vol/sbx.txt").stdout == "from-sandbox\n"
    fresh.kill()
    assert Volume.destroy(vol.volume_id) is True
    assert vol.volume_id not in _volume_dirs()
