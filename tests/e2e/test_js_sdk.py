"""The official npm `e2b` SDK against the same server, through node's test runner."""

import os
import shutil
import subprocess
from pathlib import Path

JS_DIR = Path(__file__).resolve().parent / "js"


def run_node_test(sandbar, name: str):
    node = shutil.which("node")
    assert node, "node is required for the JS SDK test (install nodejs)"
    assert (JS_DIR / "node_modules" / "e2b").is_dir(), (
        f"the npm e2b SDK is not installed: run `npm ci --prefix {JS_DIR}`"
    )
    env = dict(
        os.environ,
        E2B_API_URL=sandbar.url,
        E2B_SANDBOX_URL=sandbar.url,
        E2B_API_KEY=sandbar.api_key,
    )
    result = subprocess.run(
        [node, "--test", "--test-reporter=spec", str(JS_DIR / name)],
        cwd=JS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"node test failed:\n{result.stdout}\n{result.stderr}"


def test_js_sdk_end_to_end(sandbar):
    run_node_test(sandbar, "sdk.test.mjs")


def test_js_sdk_streams_end_with_its_error_when_the_sandbox_goes(sandbar):
    # A kill from another client, or the sandbox's timeout, while a command streams (about 4 s).
    run_node_test(sandbar, "stream_endings.test.mjs")
