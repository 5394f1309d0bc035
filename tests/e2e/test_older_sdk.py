"""An older release of the Python SDK (2.45.1, which `scripts/test.sh` installs into a
virtualenv of its own) against the same server as the newest: what code pinned to it does
still works, including the answers fixed for both (a missing path removes, a snapshot deletes
by the ID its create returned) and what the default template now carries (git, its own boot
id)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

OLD_SDK_PYTHON = Path(os.environ.get("SANDBAR_E2E_OLD_SDK_PYTHON", "/var/tmp/sandbar-e2e-sdk-2.45/bin/python3"))

SCRIPT = r'''
from importlib.metadata import version
from e2b import Sandbox

assert version("e2b") == "2.45.1", version("e2b")
host_boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
sbx = Sandbox.create(timeout=120)
try:
    lines = sbx.commands.run("echo hi; git --version; cat /proc/sys/kernel/random/boot_id").stdout.splitlines()
    assert lines[0] == "hi" and lines[1].startswith("git version"), lines
    assert lines[2] != host_boot_id, "the sandbox reads the host's boot id"

    sbx.files.write("/home/user/old.txt", "from 2.45")
    assert sbx.files.read("/home/user/old.txt") == "from 2.45"
    assert sbx.files.get_info("/home/user/old.txt").size == len("from 2.45")
    sbx.files.remove("/home/user/never-there")

    sbx.git.init("/home/user/repo")
    sbx.git.configure_user("Old SDK", "old@example.invalid", path="/home/user/repo")
    sbx.files.write("/home/user/repo/readme", "1")
    sbx.git.add("/home/user/repo")
    sbx.git.commit("/home/user/repo", "first")
    assert sbx.git.status("/home/user/repo").current_branch in ("master", "main")

    snapshot = sbx.create_snapshot()
    assert Sandbox.delete_snapshot(snapshot.snapshot_id) is True
    assert Sandbox.delete_snapshot(snapshot.snapshot_id) is False
finally:
    sbx.kill()
print("older sdk ok")
'''


def test_an_older_sdk_release_works_unchanged(sandbar):
    if not OLD_SDK_PYTHON.exists():
        pytest.fail(f"{OLD_SDK_PYTHON} is missing: scripts/test.sh installs the older SDK there")
    done = subprocess.run(
        [str(OLD_SDK_PYTHON), "-c", SCRIPT],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0 and "older sdk ok" in done.stdout, f"{done.stdout}\n{done.stderr}"
