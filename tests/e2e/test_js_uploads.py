"""Uploads from the npm `e2b` SDK while two processes keep the host's CPUs busy."""

import os
import shutil
import subprocess
from pathlib import Path

JS_DIR = Path(__file__).resolve().parent / "js"


def test_js_uploads_under_cpu_load(sandbar):
    node = shutil.which("node")
    assert node, "node is required for the JS SDK test (install nodejs)"
    assert (JS_DIR / "node_modules" / "e2b").is_dir(), f"run `npm ci --prefix {JS_DIR}`"
    env = dict(
        os.environ,
        E2B_API_URL=sandbar.url,
        E2B_SANDBOX_URL=sandbar.url,
        E2B_API_KEY=sandbar.api_key,
    )
    burners = [
        subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True) for _ in range(2)
    ]
    try:
        result = subprocess.run(
            [node, "--test", "--test-reporter=spec", str(JS_DIR / "uploads.test.mjs")],
            cwd=JS_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        for b in burners:
            b.kill()
            b.wait(timeout=10)
    assert result.returncode == 0, f"node test failed:\n{result.stdout}\n{result.stderr}"
