"""Filesystem access through envd: /files upload and download plus the filesystem RPCs."""

import base64
import hashlib
import os
import time
import urllib.request

import httpx
import pytest
from e2b import (
    FileNotFoundException,
    FileType,
    FilesystemEventType,
    NotFoundException,
    SandboxException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry
from packaging.version import Version

from e2e_util import ENVD_PORT, unique, wait_until


def test_write_read_text(sandbox):
    info = sandbox.files.write("/home/user/hello.txt", "hello world\n")
    assert info.path == "/home/user/hello.txt"
    assert info.name == "hello.txt"
    assert sandbox.files.read("/home/user/hello.txt") == "hello world\n"
    assert sandbox.commands.run("cat /home/user/hello.txt").stdout == "hello world\n"
    # overwrite
    sandbox.files.write("/home/user/hello.txt", "second")
    assert sandbox.files.read("/home/user/hello.txt") == "second"
    # unicode
    sandbox.files.write("/home/user/uni.txt", "héllo ✓")
    assert sandbox.files.read("/home/user/uni.txt") == "héllo ✓"


def test_written_file_is_owned_by_default_user(sandbox):
    sandbox.files.write("/home/user/owned.txt", "x")
    assert sandbox.commands.run("stat -c %U /home/user/owned.txt").stdout == "user\n"
    sandbox.files.write("/home/user/nested/owned/deep.txt", "x")
    assert sandbox.commands.run("stat -c %U /home/user/nested /home/user/nested/owned").stdout == "user\nuser\n"


def test_relative_path_resolves_to_home(sandbox):
    sandbox.files.write("relative-file.txt", "rel")
    assert sandbox.commands.run("cat /home/user/relative-file.txt").stdout == "rel"
    assert sandbox.files.read("relative-file.txt") == "rel"


def test_write_read_bytes_5mb(sandbox):
    data = os.urandom(5 * 1024 * 1024 + 123)
    sandbox.files.write("/tmp/blob.bin", data)
    back = sandbox.files.read("/tmp/blob.bin", format="bytes")
    assert len(back) == len(data)
    assert bytes(back) == data
    remote_sum = sandbox.commands.run("sha256sum /tmp/blob.bin").stdout.split()[0]
    assert remote_sum == hashlib.sha256(data).hexdigest()


def test_write_file_object_and_stream_read(sandbox):
    import io

    data = os.urandom(300_000)
    sandbox.files.write("/tmp/fileobj.bin", io.BytesIO(data))
    chunks = b"".join(sandbox.files.read("/tmp/fileobj.bin", format="stream"))
    assert chunks == data


def test_write_creates_nested_dirs(sandbox):
    path = "/home/user/a/b/c/d/e.txt"
    sandbox.files.write(path, "deep")
    assert sandbox.files.read(path) == "deep"
    assert sandbox.files.exists("/home/user/a/b/c")
    assert sandbox.files.get_info("/home/user/a/b/c").type == FileType.DIR


def test_write_many_files(sandbox):
    entries = [WriteEntry(path=f"/home/user/many/f{i:02d}.txt", data=f"content {i}") for i in range(20)]
    entries.append(WriteEntry(path="/home/user/many/bin.dat", data=b"\x00\x01\x02\xff"))
    infos = sandbox.files.write_files(entries)
    assert sorted(i.path for i in infos) == sorted(e["path"] for e in entries)
    names = {e.name for e in sandbox.files.list("/home/user/many")}
    assert names == {f"f{i:02d}.txt" for i in range(20)} | {"bin.dat"}
    assert sandbox.files.read("/home/user/many/f07.txt") == "content 7"
    assert bytes(sandbox.files.read("/home/user/many/bin.dat", format="bytes")) == b"\x00\x01\x02\xff"


def test_list_names_and_types(sandbox):
    sandbox.files.make_dir("/home/user/ls/sub/inner")
    sandbox.files.write("/home/user/ls/file.txt", "12345")
    sandbox.commands.run("ln -s /home/user/ls/file.txt /home/user/ls/link")
    entries = {e.name: e for e in sandbox.files.list("/home/user/ls")}
    assert set(entries) == {"sub", "file.txt", "link"}
    assert entries["sub"].type == FileType.DIR
    assert entries["file.txt"].type == FileType.FILE
    assert entries["file.txt"].path == "/home/user/ls/file.txt"
    assert entries["file.txt"].size == 5
    assert entries["link"].type == FileType.SYMLINK
    assert entries["link"].symlink_target == "/home/user/ls/file.txt"
    # depth 2 reaches into sub/
    deep = {e.path for e in sandbox.files.list("/home/user/ls", depth=2)}
    assert "/home/user/ls/sub/inner" in deep
    with pytest.raises(NotFoundException):
        sandbox.files.list("/home/user/does-not-exist")


def test_exists(sandbox):
    sandbox.files.write("/tmp/exists.txt", "x")
    assert sandbox.files.exists("/tmp/exists.txt") is True
    assert sandbox.files.exists("/tmp") is True
    assert sandbox.files.exists("/tmp/not-there-" + unique()) is False


def test_get_info(sandbox):
    sandbox.files.write("/home/user/info.txt", "abcdef")
    sandbox.commands.run("chmod 640 /home/user/info.txt")
    info = sandbox.files.get_info("/home/user/info.txt")
    assert info.name == "info.txt"
    assert info.path == "/home/user/info.txt"
    assert info.type == FileType.FILE
    assert info.size == 6
    assert info.owner == "user"
    assert info.group == "user"
    assert info.mode & 0o777 == 0o640
    assert info.permissions.endswith("rw-r-----"), info.permissions
    assert abs(info.modified_time.timestamp() - time.time()) < 300
    d = sandbox.files.get_info("/home/user")
    assert d.type == FileType.DIR
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info("/home/user/nope-" + unique())


def test_rename(sandbox):
    sandbox.files.write("/home/user/old-name.txt", "move me")
    info = sandbox.files.rename("/home/user/old-name.txt", "/home/user/new-name.txt")
    assert info.path == "/home/user/new-name.txt"
    assert info.name == "new-name.txt"
    assert not sandbox.files.exists("/home/user/old-name.txt")
    assert sandbox.files.read("/home/user/new-name.txt") == "move me"
    with pytest.raises(NotFoundException):
        sandbox.files.rename("/home/user/old-name.txt", "/home/user/x.txt")


def test_remove(sandbox):
    sandbox.files.write("/home/user/rm/one.txt", "1")
    sandbox.files.write("/home/user/rm/sub/two.txt", "2")
    sandbox.files.remove("/home/user/rm/one.txt")
    assert not sandbox.files.exists("/home/user/rm/one.txt")
    sandbox.files.remove("/home/user/rm")
    assert not sandbox.files.exists("/home/user/rm")


def test_make_dir(sandbox):
    assert sandbox.files.make_dir("/home/user/newdir/a/b") is True
    assert sandbox.files.get_info("/home/user/newdir/a/b").type == FileType.DIR
    assert sandbox.files.make_dir("/home/user/newdir/a/b") is False
    assert sandbox.commands.run("stat -c %U /home/user/newdir/a/b").stdout == "user\n"


def test_read_missing_file_raises(sandbox):
    with pytest.raises(NotFoundException):
        sandbox.files.read("/home/user/missing-" + unique())
    with pytest.raises(NotFoundException):
        sandbox.files.read("/home/user/missing-" + unique(), format="bytes")


def test_reading_a_directory_fails(sandbox):
    with pytest.raises(SandboxException):
        sandbox.files.read("/home/user")


def test_user_option_sets_owner(sandbox):
    sandbox.files.write("/root/root-only.txt", "secret", user="root")
    assert sandbox.commands.run("stat -c %U /root/root-only.txt", user="root").stdout == "root\n"
    assert sandbox.files.read("/root/root-only.txt", user="root") == "secret"
    assert sandbox.files.get_info("/root/root-only.txt", user="root").owner == "root"
    sandbox.files.write("/tmp/by-user.txt", "mine")
    assert sandbox.files.get_info("/tmp/by-user.txt").owner == "user"
    # `~` and relative paths follow the chosen user's home
    sandbox.files.write("root-home.txt", "r", user="root")
    assert sandbox.commands.run("cat /root/root-home.txt", user="root").stdout == "r"


def test_watch_dir_sees_created_file(sandbox):
    sandbox.files.make_dir("/home/user/watched")
    handle = sandbox.files.watch_dir("/home/user/watched")
    try:
        sandbox.files.write("/home/user/watched/new-file.txt", "hello")
        events = []

        def saw_create():
            events.extend(handle.get_new_events())
            return any(e.name == "new-file.txt" and e.type == FilesystemEventType.CREATE for e in events)

        wait_until(saw_create, timeout=10, interval=0.3, message="a CREATE event for new-file.txt")

        sandbox.files.remove("/home/user/watched/new-file.txt")

        def saw_remove():
            events.extend(handle.get_new_events())
            return any(e.name == "new-file.txt" and e.type == FilesystemEventType.REMOVE for e in events)

        wait_until(saw_remove, timeout=10, interval=0.3, message="a REMOVE event for new-file.txt")
    finally:
        handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()


def test_watch_dir_recursive(sandbox):
    sandbox.files.make_dir("/home/user/rwatch/sub")
    handle = sandbox.files.watch_dir("/home/user/rwatch", recursive=True)
    try:
        sandbox.files.write("/home/user/rwatch/sub/inner.txt", "x")
        events = []

        def saw():
            events.extend(handle.get_new_events())
            return any(e.name.endswith("inner.txt") for e in events)

        wait_until(saw, timeout=10, interval=0.3, message="an event for sub/inner.txt")
    finally:
        handle.stop()


@pytest.mark.parametrize("recursive", [False, True])
def test_a_new_file_written_is_created_given_its_owner_then_written(sandbox, recursive):
    # The sequence clients written against E2B count: envd opens the file, gives it to its
    # user, then writes.
    base = f"/home/user/{unique('sequence')}"
    sandbox.files.make_dir(f"{base}/sub")
    watched, name = (base, "sub/new.txt") if recursive else (f"{base}/sub", "new.txt")
    handle = sandbox.files.watch_dir(watched, recursive=recursive)
    try:
        sandbox.files.write(f"{base}/sub/new.txt", "content")
        events = []

        def saw_write():
            events.extend(e for e in handle.get_new_events() if e.name == name)
            return any(e.type == FilesystemEventType.WRITE for e in events)

        wait_until(saw_write, timeout=10, interval=0.3, message=f"a WRITE event for {name}")
        time.sleep(0.5)
        events.extend(e for e in handle.get_new_events() if e.name == name)
        assert [e.type for e in events] == [
            FilesystemEventType.CREATE,
            FilesystemEventType.CHMOD,
            FilesystemEventType.WRITE,
        ], events
    finally:
        handle.stop()


def test_a_directory_reports_its_own_size(sandbox):
    path = f"/home/user/{unique('sized')}"
    sandbox.files.make_dir(path)
    info = sandbox.files.get_info(path)
    assert info.type == FileType.DIR
    # A directory takes at least a block, as `stat` shows on the ext4 roots E2B runs.
    assert info.size >= 4096 and info.size % 4096 == 0, info


def test_watch_missing_dir_raises(sandbox):
    with pytest.raises(NotFoundException):
        sandbox.files.watch_dir("/home/user/not-a-dir-" + unique())


# ---- signed URLs ---------------------------------------------------------


def _routing_headers(sbx):
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}


def _post_file(sbx, url: str, path: str, payload: bytes, content_type: str = "text/plain") -> httpx.Response:
    """A multipart upload of `payload` as `path` to the signed `url`, with the routing headers."""
    return httpx.post(
        url, files={"file": (path, payload, content_type)}, headers=_routing_headers(sbx), timeout=30
    )


def test_download_url_plain_http(sandbox):
    sandbox.files.write("/home/user/dl.txt", "download me")
    url = sandbox.download_url("/home/user/dl.txt")
    assert "signature=" in url
    # Exactly as a user would: a plain GET of the URL the SDK hands out. With
    # E2B_SANDBOX_URL set, that URL names no sandbox (no ID in host or path, no
    # routing headers), so the server has to find the sandbox from the signature.
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, f"plain GET {url} -> {r.status_code} {r.text[:200]}"
    assert r.content == b"download me"
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        assert resp.read() == b"download me"


def test_download_url_with_routing_headers(sandbox):
    sandbox.files.write("/home/user/dl2.txt", "download me too")
    url = sandbox.download_url("/home/user/dl2.txt")
    r = httpx.get(url, headers=_routing_headers(sandbox), timeout=30)
    assert r.status_code == 200, r.text
    assert r.content == b"download me too"


def test_download_url_rejects_bad_or_expired_signature(sandbox):
    sandbox.files.write("/home/user/dl3.txt", "guarded")
    url = sandbox.download_url("/home/user/dl3.txt")
    # signature for a different path
    other = sandbox.download_url("/home/user/other.txt")
    forged = url.split("&signature=")[0] + "&signature=" + other.split("&signature=")[1]
    r = httpx.get(forged, headers=_routing_headers(sandbox), timeout=30)
    assert r.status_code in (401, 403), f"{r.status_code} {r.text}"
    assert b"guarded" not in r.content
    # expired
    expired = sandbox.download_url("/home/user/dl3.txt", use_signature_expiration=-60)
    r = httpx.get(expired, headers=_routing_headers(sandbox), timeout=30)
    assert r.status_code in (401, 403), f"{r.status_code} {r.text}"
    # Clients match envd's words.
    assert "signature is already expired" in r.text, r.text
    # no signature and no token
    bare = url.split("&signature=")[0]
    r = httpx.get(bare, headers=_routing_headers(sandbox), timeout=30)
    assert r.status_code == 401, f"{r.status_code} {r.text}"
    # a still-valid expiring signature works
    fresh = sandbox.download_url("/home/user/dl3.txt", use_signature_expiration=120)
    r = httpx.get(fresh, headers=_routing_headers(sandbox), timeout=30)
    assert r.status_code == 200 and r.content == b"guarded"


def test_upload_url(sandbox):
    url = sandbox.upload_url("/home/user/uploaded/via-url.txt")
    payload = b"uploaded through a signed URL\n"
    r = _post_file(sandbox, url, "/home/user/uploaded/via-url.txt", payload, "application/octet-stream")
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    body = r.json()
    assert isinstance(body, list) and body and body[0]["path"] == "/home/user/uploaded/via-url.txt"
    assert bytes(sandbox.files.read("/home/user/uploaded/via-url.txt", format="bytes")) == payload
    assert sandbox.commands.run("stat -c %U /home/user/uploaded/via-url.txt").stdout == "user\n"


def test_upload_url_plain_http(sandbox):
    url = sandbox.upload_url("/home/user/plain-upload.txt")
    # plain POST of the URL the SDK hands out, no routing headers (see test_download_url_plain_http)
    r = httpx.post(url, files={"file": ("/home/user/plain-upload.txt", b"plain", "text/plain")}, timeout=30)
    assert r.status_code == 200, f"plain POST {url} -> {r.status_code} {r.text[:200]}"
    assert sandbox.files.read("/home/user/plain-upload.txt") == "plain"


def test_a_signed_url_is_not_turned_into_roots_by_a_basic_header(sandbox):
    # Signed without a user: the sandbox's default user (`user`), whatever header comes along.
    url = sandbox.upload_url("/home/user/signed-owner.txt")
    as_root = {"Authorization": "Basic " + base64.b64encode(b"root:").decode()}
    r = httpx.post(url, files={"file": ("signed-owner.txt", b"x", "text/plain")}, headers=as_root, timeout=30)
    assert r.status_code == 401, f"{r.status_code} {r.text}"
    assert "signed for user 'user'" in r.text, r.text
    assert not sandbox.files.exists("/home/user/signed-owner.txt")
    r = httpx.get(sandbox.download_url("/etc/shadow"), headers=as_root, timeout=30)
    assert r.status_code == 401 and b"root:" not in r.content, f"{r.status_code} {r.text}"
    # Naming the signed user, or no one, is what the URL grants.
    as_user = {"Authorization": "Basic " + base64.b64encode(b"user:").decode()}
    r = httpx.post(url, files={"file": ("signed-owner.txt", b"x", "text/plain")}, headers=as_user, timeout=30)
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    assert sandbox.commands.run("stat -c %U /home/user/signed-owner.txt").stdout == "user\n"


def test_upload_url_signature_is_bound_to_path(sandbox):
    url = sandbox.upload_url("/home/user/allowed.txt")
    wrong = url.replace("allowed.txt", "sneaky.txt")
    r = _post_file(sandbox, wrong, "/home/user/sneaky.txt", b"x")
    assert r.status_code in (401, 403), f"{r.status_code} {r.text}"
    assert not sandbox.files.exists("/home/user/sneaky.txt")
    # a read signature cannot be used to write
    read_url = sandbox.download_url("/home/user/allowed.txt")
    r = _post_file(sandbox, read_url, "/home/user/allowed.txt", b"x")
    assert r.status_code in (401, 403), f"{r.status_code} {r.text}"
    assert not sandbox.files.exists("/home/user/allowed.txt")


# ---- gzip ------------------------------------------------------------------


def test_gzip_write_and_read(sandbox):
    if sandbox._envd_version < Version("0.5.7"):
        pytest.skip(f"envd {sandbox._envd_version} predates gzip uploads (0.5.7)")
    text = "compress me " * 10_000
    sandbox.files.write("/home/user/gz.txt", text, gzip=True)
    assert sandbox.commands.run("wc -c < /home/user/gz.txt").stdout.strip() == str(len(text))
    assert sandbox.files.read("/home/user/gz.txt", gzip=True) == text
    data = os.urandom(200_000)
    sandbox.files.write("/home/user/gz.bin", data, gzip=True)
    assert bytes(sandbox.files.read("/home/user/gz.bin", format="bytes", gzip=True)) == data


def test_octet_stream_upload(sandbox):
    if sandbox._envd_version < Version("0.5.7"):
        pytest.skip(f"envd {sandbox._envd_version} predates octet-stream uploads (0.5.7)")
    data = os.urandom(100_000)
    sandbox.files.write("/home/user/octet.bin", data, use_octet_stream=True)
    assert bytes(sandbox.files.read("/home/user/octet.bin", format="bytes")) == data


def test_files_of_killed_sandbox_are_unreachable(make_sandbox):
    sbx = make_sandbox(timeout=60)
    sbx.files.write("/home/user/x.txt", "x")
    sbx.kill()
    with pytest.raises(SandboxException):
        sbx.files.read("/home/user/x.txt")


def test_removing_what_is_not_there_succeeds(sandbox):
    """Like `rm -rf`: a missing path, or one under a missing directory, is removed already."""
    sandbox.files.remove("/home/user/never-was")
    sandbox.files.remove("/home/user/never/was/here")
    sandbox.files.write("/home/user/once.txt", "x")
    sandbox.files.remove("/home/user/once.txt")
    sandbox.files.remove("/home/user/once.txt")
    assert not sandbox.files.exists("/home/user/once.txt")
