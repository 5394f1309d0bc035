"""A sandbox is a machine of its own: every boot of it has a boot id of its own at
`/proc/sys/kernel/random/boot_id` (the same after a resume with memory, in the freezer or
from a checkpoint, a new one after a resume without memory), and it has an `/etc/machine-id`
of its own for its whole life. A fork or a sandbox made from a snapshot is a new machine: new
boot id, new machine id. The escape probes on the boot id's mount are in test_escape.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from e2e_util import kill_quietly, require_checkpoints, state_of, wait_until

BOOT_ID = "/proc/sys/kernel/random/boot_id"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
MACHINE_ID = re.compile(r"^[0-9a-f]{32}$")
HOST_BOOT_ID = Path(BOOT_ID).read_text().strip()


def identity(sbx: Sandbox) -> tuple:
    """(boot id, machine id) as the sandbox's processes read them."""
    out = sbx.commands.run(f"cat {BOOT_ID} /etc/machine-id").stdout.split()
    assert len(out) == 2, out
    return out[0], out[1]


@pytest.fixture(scope="module")
def pair(sandbar):
    made = []
    try:
        for _ in range(2):
            made.append(Sandbox.create(timeout=300))
        yield made
    finally:
        for sbx in made:
            kill_quietly(sbx.sandbox_id)


def test_each_sandbox_has_its_own_boot_and_machine_id(pair):
    (a_boot, a_machine), (b_boot, b_machine) = identity(pair[0]), identity(pair[1])
    assert UUID.match(a_boot) and UUID.match(b_boot), (a_boot, b_boot)
    assert MACHINE_ID.match(a_machine) and MACHINE_ID.match(b_machine), (a_machine, b_machine)
    assert len({a_boot, b_boot, HOST_BOOT_ID}) == 3
    host_machine = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else None
    assert len({a_machine, b_machine, host_machine}) == 3
    # Stable while the sandbox runs; the machine id's file is root's and read-only, as systemd
    # leaves it.
    assert identity(pair[0]) == (a_boot, a_machine)
    assert pair[0].commands.run("stat -c '%U %a' /etc/machine-id").stdout == "root 444\n"


def test_a_resume_with_memory_keeps_both_ids(pair):
    sbx = pair[0]
    before = identity(sbx)
    assert sbx.pause() is True
    # Resumed at once: thawed from the freezer, well within the checkpoint grace.
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300)
    assert identity(resumed) == before


def test_a_resume_from_a_checkpoint_keeps_both_ids(sandbar, pair):
    require_checkpoints(sandbar)
    sbx = pair[1]
    before = identity(sbx)
    assert sbx.pause() is True
    header = sandbar.data_dir / "checkpoints" / sbx.sandbox_id / "header"
    wait_until(header.exists, timeout=30, message="the paused sandbox to be checkpointed")
    time.sleep(0.2)
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300)
    assert not header.exists()
    assert identity(resumed) == before
    # The restored bind is as read-only as the booted one.
    line = resumed.commands.run(f"grep ' {BOOT_ID} ' /proc/self/mountinfo").stdout
    assert " ro," in line and " - tmpfs " in line, line


def test_a_resume_without_memory_is_a_new_boot_of_the_same_machine(sandbar, pair):
    sbx = pair[0]
    boot, machine = identity(sbx)
    assert sbx.pause(mode="filesystem") is True
    assert state_of(sandbar, sbx.sandbox_id) == "paused"
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300)
    new_boot, same_machine = identity(resumed)
    assert UUID.match(new_boot) and new_boot not in (boot, HOST_BOOT_ID)
    assert same_machine == machine


def test_forks_and_snapshot_sandboxes_are_new_machines(sandbar, pair):
    require_checkpoints(sandbar, "snapshot memory")
    source = pair[1]
    boot, machine = identity(source)
    forks = [f for f in source.fork(count=2, timeout=60) if hasattr(f, "sandbox_id")]
    try:
        assert len(forks) == 2
        ids = [identity(Sandbox.connect(f.sandbox_id)) for f in forks]
        boots = {b for b, _ in ids} | {boot, HOST_BOOT_ID}
        machines = {m for _, m in ids} | {machine}
        assert len(boots) == 4 and len(machines) == 3, (ids, boot, machine)
        # The source goes on as the machine it was.
        assert identity(source) == (boot, machine)
    finally:
        for f in forks:
            kill_quietly(f.sandbox_id)
