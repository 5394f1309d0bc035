"""A CRIU installed while the server runs turns checkpoints on without a restart.

The shared server is restarted with `--criu` naming a path that does not exist yet and
`--criu-reprobe-secs 1`; a snapshot with memory is refused, the test then copies the installed
CRIU to that path, and the next snapshot with memory works. The server is restarted with its
usual options afterwards. About 10 s; skipped where the installed CRIU does not pass the
server's probe.
"""

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxException

from e2e_util import require_checkpoints

INSTALLED = Path("/usr/local/sbin/criu")


@pytest.fixture
def criu_missing_at_start(sandbar):
    require_checkpoints(sandbar)
    later = Path(tempfile.mkdtemp(prefix="sandbar-e2e-criu-")) / "criu"
    usual = list(sandbar.extra_args)
    sandbar.extra_args = usual + ["--criu", str(later), "--criu-reprobe-secs", "1"]
    mark = sandbar.log_path.stat().st_size
    try:
        sandbar.restart()
        yield later, mark
    finally:
        sandbar.extra_args = usual
        sandbar.restart()
        shutil.rmtree(later.parent, ignore_errors=True)


def log_since(sandbar, mark: int) -> str:
    with open(sandbar.log_path, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


def test_a_criu_installed_after_the_start_turns_checkpoints_on(sandbar, criu_missing_at_start, make_sandbox):
    later, mark = criu_missing_at_start
    assert "checkpoints are off" in log_since(sandbar, mark)
    sbx = make_sandbox()
    with pytest.raises(SandboxException) as refused:
        sbx.create_snapshot()
    assert "checkpoints are off" in str(refused.value), str(refused.value)

    shutil.copy2(INSTALLED, later)
    time.sleep(1.1)
    snapshot = sbx.create_snapshot()
    try:
        assert "CRIU passed its probe" in log_since(sandbar, mark)
        copy = make_sandbox(template=snapshot.snapshot_id)
        assert copy.commands.run("echo copied").stdout == "copied\n"
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0])
