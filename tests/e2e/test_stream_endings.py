"""A sandbox that goes away while a client streams a command's output.

A second client kills the sandbox (or its timeout passes) while the first reads a command's
output; the first must get the SDK's own error for a sandbox that is no longer running, not a
transport error such as "unexpected EOF during chunk size line". About 5 s.
"""

import threading

import httpx
import pytest
from e2b import Sandbox, SandboxNotRunningException

from e2e_util import wait_until

# Prints a line a second for half a minute: the stream is open long after the kill.
TICKER = "for i in $(seq 30); do echo tick $i; sleep 1; done"


def expected_start(sandbox_id: str) -> str:
    # The edge's end-of-stream message, then what the SDK adds for a sandbox not found.
    return (
        "The sandbox was not found: the sandbox was killed or reached its end of life "
        f"(sandbox '{sandbox_id}'): "
        "The sandbox was killed or reached its timeout."
    )


def kill_from_another_client(sandbox_id: str) -> threading.Thread:
    killer = threading.Thread(target=Sandbox.kill, args=(sandbox_id,))
    killer.start()
    return killer


def assert_not_running(error: BaseException, sandbox_id: str):
    assert type(error) is SandboxNotRunningException, repr(error)
    assert str(error).startswith(expected_start(sandbox_id)), str(error)
    assert "EOF" not in str(error) and "body" not in str(error), str(error)


# "2" is the SDK's default; both settings are tried since they build different transports.
@pytest.mark.parametrize("http_version", ["2", "1.1"])
def test_a_kill_ends_a_foreground_command_with_the_sdks_not_running_error(
    sandbar, make_sandbox, monkeypatch, http_version
):
    monkeypatch.setenv("E2B_HTTP_VERSION", http_version)
    sbx = make_sandbox(timeout=60)
    seen = []
    killers = []

    def on_stdout(line):
        seen.append(line)
        if not killers:
            killers.append(kill_from_another_client(sbx.sandbox_id))

    with pytest.raises(SandboxNotRunningException) as caught:
        sbx.commands.run(TICKER, on_stdout=on_stdout, timeout=0)
    killers[0].join(timeout=10)
    assert_not_running(caught.value, sbx.sandbox_id)
    assert seen[0] == "tick 1\n"
    # What the SDK probes after a failed request says the same.
    health = httpx.get(
        f"{sandbar.url}/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id}, timeout=10
    )
    assert health.status_code == 502
    assert "was not found" in health.json()["message"]


def test_a_kill_ends_the_wait_of_a_background_command(make_sandbox):
    sbx = make_sandbox(timeout=60)
    handle = sbx.commands.run(TICKER, background=True, timeout=0)
    wait_until(
        lambda: sbx.commands.run("pgrep -f 'seq 30'").exit_code == 0,
        timeout=10,
        message="the ticker to run",
    )
    kill_from_another_client(sbx.sandbox_id).join(timeout=10)
    with pytest.raises(SandboxNotRunningException) as caught:
        handle.wait()
    assert_not_running(caught.value, sbx.sandbox_id)


def test_the_end_of_a_sandboxs_timeout_ends_its_streams_the_same_way(make_sandbox):
    sbx = make_sandbox(timeout=3)
    with pytest.raises(SandboxNotRunningException) as caught:
        sbx.commands.run(TICKER, timeout=0)
    assert_not_running(caught.value, sbx.sandbox_id)
