#!/usr/bin/env python3
"""Template benchmarks against a running server, through the official Python SDK.

Prints, as a Markdown table: a fully cached rebuild of a six-step template, and create to
first output from a template with five build-step layers next to `base`.

    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \\
    E2B_API_KEY=e2b_... python3 scripts/bench-templates.py [--iterations 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from pathlib import Path

from e2b import Sandbox, Template
from bench_common import row_p90 as row, timed


def first_output(template: str) -> None:
    sbx = Sandbox.create(template, timeout=60)
    try:
        out = sbx.commands.run("echo ready")
        assert out.stdout == "ready\n", out
    finally:
        sbx.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    name = f"bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "data.txt").write_text("payload\n")
        template = (
            Template(file_context_path=ctx)
            .from_template("base")
            .run_cmd("echo one > /tmp/one", user="root")
            .run_cmd("echo two > /tmp/two", user="root")
            .copy("data.txt", "/opt/data.txt")
            .run_cmd("echo three > /tmp/three", user="root")
            .run_cmd("echo four > /tmp/four", user="root")
            .set_envs({"BENCH": "1"})
        )
        cold = timed(lambda: Template.build(template, name))
        cached = [timed(lambda: Template.build(template, name)) for _ in range(args.iterations)]
    for _ in range(2):
        first_output("base")
        first_output(name)
    base = [timed(lambda: first_output("base")) for _ in range(args.iterations)]
    custom = [timed(lambda: first_output(name)) for _ in range(args.iterations)]
    print("| measurement | n | p50 ms | p90 ms | min ms |")
    print("|---|---|---|---|---|")
    print(f"| first build of the six-step template | 1 | {cold:.1f} | {cold:.1f} | {cold:.1f} |")
    print(row("fully cached rebuild through `Template.build`", cached))
    print(row("create → first output, `base` (1 layer)", base))
    print(row("create → first output, custom template (base + 5 step layers)", custom))
    ratio = statistics.median(custom) / statistics.median(base)
    print(f"\ncustom / base create→first output (p50): {ratio:.2f}×")


if __name__ == "__main__":
    main()
