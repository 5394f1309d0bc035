"""What the SDKs enable by envd version past 0.5.7, through the stock Python SDK: file metadata
(0.6.2), entries in watch events (0.6.3) and watching with `allow_network_mounts` (0.6.4).

One sandbox serves the whole module; every test works in a directory of its own."""

import json

import httpx
import pytest
from e2b import FileType, FilesystemEventType, InvalidArgumentException, Sandbox
from e2b.sandbox.filesystem.filesystem import WriteEntry
from packaging.version import Version

from e2e_util import ENVD_PORT, created_sandbox, unique, wait_until

REPORTED_ENVD = Version("0.6.4")


@pytest.fixture(scope="module")
def sbx(sandbar):
    with created_sandbox(timeout=180) as sandbox:
        yield sandbox


@pytest.fixture
def workdir(sbx):
    path = f"/home/user/meta-{unique()}"
    sbx.files.make_dir(path)
    return path


def xattrs(sbx, path):
    """The file's `user.*` attributes as the sandbox's own tools see them."""
    script = (
        "import os, sys, json; p = sys.argv[1]; "
        "print(json.dumps({n: os.getxattr(p, n).decode() for n in os.listxattr(p) if n.startswith('user.')}))"
    )
    return json.loads(sbx.commands.run(f"python3 -c \"{script}\" {path}").stdout)


def test_envd_version_enables_the_newer_features(sbx):
    assert Version(Sandbox.get_info(sbx.sandbox_id).envd_version) == REPORTED_ENVD
    assert sbx._envd_version == REPORTED_ENVD


def test_write_with_metadata_is_kept_as_xattrs(sbx, workdir):
    path = f"{workdir}/report.txt"
    info = sbx.files.write(path, "content", metadata={"Owner": "alice", "purpose": "e2e run"})
    # Keys are lower-cased by the sandbox, as envd does.
    expected = {"owner": "alice", "purpose": "e2e run"}
    assert info.metadata == expected
    assert xattrs(sbx, path) == {"user.e2b.owner": "alice", "user.e2b.purpose": "e2e run"}
    assert sbx.files.get_info(path).metadata == expected
    assert sbx.files.read(path) == "content"
    assert sbx.commands.run(f"stat -c %U {path}").stdout == "user\n"

    listed = {e.name: e for e in sbx.files.list(workdir)}
    assert listed["report.txt"].metadata == expected

    moved = sbx.files.rename(path, f"{workdir}/moved.txt")
    assert moved.metadata == expected
    assert sbx.files.get_info(f"{workdir}/moved.txt").metadata == expected

    # A symlink reports what its target holds, as envd does.
    sbx.commands.run(f"ln -s {workdir}/moved.txt {workdir}/link")
    link = sbx.files.get_info(f"{workdir}/link")
    assert link.type == FileType.SYMLINK
    assert link.metadata == expected


def test_overwrite_replaces_or_clears_metadata(sbx, workdir):
    path = f"{workdir}/f.txt"
    sbx.files.write(path, "one", metadata={"a": "1", "b": "2"})
    again = sbx.files.write(path, "two", metadata={"b": "3"})
    assert again.metadata == {"b": "3"}
    assert sbx.files.get_info(path).metadata == {"b": "3"}

    plain = sbx.files.write(path, "three")
    assert plain.metadata is None
    assert sbx.files.get_info(path).metadata is None
    assert xattrs(sbx, path) == {}
    # A directory and a file without metadata report none.
    assert sbx.files.get_info(workdir).metadata is None


def test_write_files_octet_stream_and_gzip_carry_metadata(sbx, workdir):
    meta = {"batch": "7"}
    infos = sbx.files.write_files(
        [WriteEntry(path=f"{workdir}/m1.txt", data="1"), WriteEntry(path=f"{workdir}/m2.txt", data="2")],
        metadata=meta,
    )
    assert [i.metadata for i in infos] == [meta, meta]
    streamed = sbx.files.write(f"{workdir}/s.bin", b"\x00\x01", use_octet_stream=True, metadata=meta)
    assert streamed.metadata == meta
    zipped = sbx.files.write(f"{workdir}/z.txt", "zz" * 1000, gzip=True, metadata=meta)
    assert zipped.metadata == meta
    for name in ("m1.txt", "m2.txt", "s.bin", "z.txt"):
        assert sbx.files.get_info(f"{workdir}/{name}").metadata == meta, name
    assert sbx.files.read(f"{workdir}/z.txt") == "zz" * 1000


def test_metadata_set_inside_the_sandbox_is_reported(sbx, workdir):
    path = f"{workdir}/tool.txt"
    sbx.files.write(path, "x")
    sbx.commands.run(
        f"python3 -c \"import os; os.setxattr('{path}', 'user.e2b.tool', b'setfattr'); "
        f"os.setxattr('{path}', 'user.other', b'not ours')\""
    )
    assert sbx.files.get_info(path).metadata == {"tool": "setfattr"}


def test_metadata_over_the_limit_is_refused_before_writing(sbx, workdir):
    path = f"{workdir}/big.txt"
    # The SDK checks only the characters; the agent enforces envd's 4 KiB per file.
    with pytest.raises(InvalidArgumentException, match="metadata"):
        sbx.files.write(path, "x", metadata={"k": "v" * 5000})
    assert not sbx.files.exists(path)
    # A value outside printable US-ASCII never leaves the SDK; sent raw, the agent refuses it
    # as envd does.
    response = httpx.post(
        sbx.upload_url(f"{workdir}/raw.txt"),
        content=b"x",
        headers={
            "Content-Type": "application/octet-stream",
            "X-Metadata-k": b"caf\xc3\xa9",
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": str(ENVD_PORT),
        },
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "metadata" in response.json()["message"]
    assert not sbx.files.exists(f"{workdir}/raw.txt")


def _collect(handle, events, predicate):
    def seen():
        events.extend(handle.get_new_events())
        return any(predicate(e) for e in events)

    return seen


def test_watch_events_carry_entries(sbx, workdir):
    handle = sbx.files.watch_dir(workdir, include_entry=True)
    plain = sbx.files.watch_dir(workdir)
    try:
        sbx.files.write(f"{workdir}/w.txt", "hello", metadata={"stage": "new"})
        events = []
        wait_until(
            _collect(handle, events, lambda e: e.name == "w.txt" and e.entry is not None and e.entry.metadata),
            timeout=10,
            interval=0.2,
            message="an event for w.txt carrying its entry with metadata",
        )
        create = next(e for e in events if e.type == FilesystemEventType.CREATE)
        assert create.entry is not None
        assert create.entry.name == "w.txt"
        assert create.entry.path == f"{workdir}/w.txt"
        assert create.entry.type == FileType.FILE
        assert create.entry.owner == "user"
        assert any(e.entry.metadata == {"stage": "new"} for e in events if e.entry)

        sbx.files.remove(f"{workdir}/w.txt")
        wait_until(
            _collect(handle, events, lambda e: e.type == FilesystemEventType.REMOVE),
            timeout=10,
            interval=0.2,
            message="a REMOVE event for w.txt",
        )
        # The entry is gone: a remove event describes nothing.
        assert all(e.entry is None for e in events if e.type == FilesystemEventType.REMOVE)

        without = plain.get_new_events()
        assert any(e.name == "w.txt" for e in without)
        assert all(e.entry is None for e in without)
    finally:
        handle.stop()
        plain.stop()


def test_watch_with_allow_network_mounts(sbx, workdir):
    # Nothing in a sandbox is a network filesystem, so allowing them changes nothing: the
    # watch starts and sees events, recursively too.
    sbx.files.make_dir(f"{workdir}/sub")
    handle = sbx.files.watch_dir(workdir, recursive=True, include_entry=True, allow_network_mounts=True)
    try:
        sbx.files.write(f"{workdir}/sub/n.txt", "n")
        events = []
        wait_until(
            _collect(handle, events, lambda e: e.name == "sub/n.txt" and e.entry is not None),
            timeout=10,
            interval=0.2,
            message="an event for sub/n.txt with its entry",
        )
    finally:
        handle.stop()
