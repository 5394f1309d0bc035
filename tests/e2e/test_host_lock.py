"""One server per host: a second `sandbar serve` next to the running one refuses to start and
touches nothing of the first (its sandboxes keep running, nothing is mounted for it)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from e2e_util import free_port, host_mounts_mentioning


def test_a_second_server_on_the_host_refuses_to_start(sandbar, sandbox):
    assert sandbox.commands.run("echo before").stdout == "before\n"
    with tempfile.TemporaryDirectory(prefix="sandbar-e2e-second-", dir="/var/tmp") as data_dir:
        second = subprocess.run(
            [
                str(sandbar.binary),
                "serve",
                "--listen",
                f"127.0.0.1:{free_port()}",
                "--data-dir",
                data_dir,
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "RUST_LOG": "warn"},
        )
        assert second.returncode != 0
        assert f"another sandbar server (pid {sandbar.pid}) runs on this host" in second.stderr
        assert host_mounts_mentioning(data_dir) == []
        assert not (Path(data_dir) / "sandboxes.img").exists()

    # The first server and its sandbox carry on as before.
    assert sandbox.commands.run("echo after").stdout == "after\n"
    assert sandbar.client().get("/health").status_code in (200, 204)
