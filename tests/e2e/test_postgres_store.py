"""A server keeping its records in PostgreSQL finds its sandboxes again after a restart.

The module starts a PostgreSQL 15 cluster of its own (initdb in a temporary directory, run as
the `postgres` user, listening only on a Unix socket there) and a server of its own on it with
`--database-url`, with a fresh data dir that borrows the shared server's `base` root read-only,
so nothing is downloaded. The shared server is stopped meanwhile (one server per host) and
started again afterwards. A sandbox created with the Python SDK survives a SIGTERM restart:
listed, connected to, its file and process still there, and no SQLite database is made.
About 15 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import conftest
from e2e_util import (
    SHARED_BASE,
    bind_shared_base,
    module_server,
    point_sdk_at,
    sh,
    shared_server_set_aside,
    unmount_under,
)

PG_BIN = Path(os.environ.get("SANDBAR_PG_BIN") or "/usr/lib/postgresql/15/bin")


def as_postgres(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh("runuser", "-u", "postgres", "--", *args, check=check)


class Cluster:
    """A throwaway cluster on a Unix socket in its own directory; no TCP."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="sandbar-e2e-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        self.started = False

    def start(self) -> None:
        # Should this run die before its cleanup, the cluster still goes when it does.
        subprocess.Popen(
            ["runuser", "-u", "postgres", "--", "sh", "-c",
             'while [ -e "/proc/$0" ]; do sleep 1; done; "$1/pg_ctl" -D "$2/data" stop -m immediate; rm -rf "$2"',
             str(os.getpid()), str(PG_BIN), str(self.dir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                    "--no-sync", "-E", "UTF8", "--no-locale")
        options = f"-c listen_addresses='' -k {self.dir} -c fsync=off"
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w",
                    "-t", "60", "-o", options, "start")
        self.started = True
        as_postgres(str(PG_BIN / "psql"), "-h", str(self.dir), "-U", "postgres", "-q",
                    "-c", "CREATE DATABASE sandbar")

    @property
    def url(self) -> str:
        return f"postgres://postgres@localhost/sandbar?host={self.dir}"

    def query(self, sql: str) -> str:
        return as_postgres(str(PG_BIN / "psql"), "-h", str(self.dir), "-U", "postgres", "-d", "sandbar",
                           "-tA", "-c", sql).stdout.strip()

    def stop(self) -> None:
        if self.started:
            as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "stop", "-m", "fast", check=False)
            self.started = False
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_server(sandbar):
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL binaries in {PG_BIN} (scripts/install-deps.sh --test installs them)")
    with shared_server_set_aside(sandbar, SHARED_BASE):
        cluster = Cluster()
        tag = uuid.uuid4().hex[:10]
        data_dir = Path(f"/var/tmp/sandbar-e2e-pg-{tag}")
        server = module_server(
            data_dir,
            f"postgres-store-{tag}",
            conftest.FAKE_DNS.address,
            # Nothing here measures disks; no pool image to allocate.
            ["--database-url", cluster.url, "--disk-quotas", "false"],
        )
        try:
            cluster.start()
            bind_shared_base(data_dir)
            server.start()
            server.wait_healthy(timeout=60)
            server.wait_base_template(timeout=60)
            point_sdk_at(server.url)
            yield server, cluster
        finally:
            problems = []
            if server.proc is not None:
                server.delete_sandboxes_in_teardown(problems)
                server.stop_in_teardown(problems)
            unmount_under(data_dir)
            shutil.rmtree(data_dir, ignore_errors=True)
            shutil.rmtree(server.binary.parent, ignore_errors=True)
            cluster.stop()
            assert not problems, "; ".join(problems)


def test_sandboxes_survive_a_restart_with_records_in_postgres(pg_server):
    from e2b import Sandbox, SandboxQuery

    server, cluster = pg_server
    started = time.monotonic()
    sbx = Sandbox.create(template="base", timeout=300, metadata={"store": "postgres"})
    sbx.files.write("/home/user/kept.txt", "in postgres")
    sbx.commands.run("sleep 600", background=True)
    assert cluster.query(f"SELECT status FROM sandboxes WHERE id = '{sbx.sandbox_id}'") == "running"

    server.stop(kill9=False)
    server.start()
    server.wait_healthy(timeout=60)

    listed = {s.sandbox_id: s for s in Sandbox.list(query=SandboxQuery(metadata={"store": "postgres"})).next_items()}
    assert sbx.sandbox_id in listed, f"not listed after the restart: {sorted(listed)}"
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/kept.txt") == "in postgres"
    assert "sleep 600" in again.commands.run("ps -eo args").stdout
    assert not (server.data_dir / "sandbar.db").exists(), "records went to SQLite"
    again.kill()
    assert cluster.query(f"SELECT count(*) FROM sandboxes WHERE id = '{sbx.sandbox_id}'") == "0"
    assert time.monotonic() - started < 30
