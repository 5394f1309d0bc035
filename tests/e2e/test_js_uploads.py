"""Uploads from the npm `e2b` SDK while two processes keep the host's CPUs busy."""

import subprocess

from e2e_util import run_node_test


def test_js_uploads_under_cpu_load(sandbar):
    burners = [
        subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True) for _ in range(2)
    ]
    try:
        run_node_test(sandbar, "uploads.test.mjs", timeout=240)
    finally:
        for b in burners:
            b.kill()
            b.wait(timeout=10)
