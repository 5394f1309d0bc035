"""The official npm `e2b` SDK against the same server, through node's test runner."""

from e2e_util import run_node_test


def test_js_sdk_end_to_end(sandbar):
    run_node_test(sandbar, "sdk.test.mjs")


def test_js_sdk_streams_end_with_its_error_when_the_sandbox_goes(sandbar):
    # A kill from another client, or the sandbox's timeout, while a command streams (about 4 s).
    run_node_test(sandbar, "stream_endings.test.mjs")
