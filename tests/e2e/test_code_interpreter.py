"""E2B's code interpreter SDK (`e2b_code_interpreter`), unchanged, against the built-in
`code-interpreter-v1` template: stateful Python and bash kernels, contexts, streamed output
and callbacks, rich results, errors, timeouts, environment variables, reconnects, a pause, the
access token executions need on port 49999, sandboxes restored from the template's capture
sharing no state, and a snapshot of a kernel's state.

The template is built in the background when the server starts; the module waits for it
(minutes on a machine's first run, nothing once it is cached). One sandbox serves the whole
module, a few more the pause, capture and snapshot tests.
"""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
from e2b import InvalidArgumentException, NotFoundException, SandboxException, TimeoutException

from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import ChartType

from e2e_util import TEMPLATE_WAIT_S, checkpoints_off, created_sandbox, require_checkpoints

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def interpreter_template(sandbar):
    return sandbar.wait_template("code-interpreter-v1", timeout=TEMPLATE_WAIT_S)


@pytest.fixture(scope="module")
def sbx(sandbar, interpreter_template):
    with created_sandbox(Sandbox, timeout=300, envs={"GLOBAL_VAR": "from-create"}) as sandbox:
        yield sandbox


def test_the_default_template_is_the_interpreter(sbx, interpreter_template):
    assert sbx.get_info().template_id == interpreter_template["templateID"]


def test_python_keeps_state_between_calls(sbx):
    first = sbx.run_code("x = 41")
    assert first.error is None and first.results == []
    second = sbx.run_code("x += 1\nx")
    assert second.text == "42"
    assert second.execution_count == first.execution_count + 1
    assert second.results[0].is_main_result


def test_callbacks_arrive_in_order(sbx):
    events = []
    code = (
        "import sys, time\n"
        "print('to stdout', flush=True); time.sleep(0.2)\n"
        "print('to stderr', file=sys.stderr, flush=True); time.sleep(0.2)\n"
        "display('displayed')\n"
        "'the result'"
    )
    execution = sbx.run_code(
        code,
        on_stdout=lambda m: events.append(("stdout", m.line)),
        on_stderr=lambda m: events.append(("stderr", m.line)),
        on_result=lambda r: events.append(("result", r.text, r.is_main_result)),
        on_error=lambda e: events.append(("error", e.name)),
    )
    assert events == [
        ("stdout", "to stdout\n"),
        ("stderr", "to stderr\n"),
        ("result", "displayed", False),
        ("result", "the result", True),
    ]
    assert execution.logs.stdout == ["to stdout\n"]
    assert execution.logs.stderr == ["to stderr\n"]
    assert execution.text == "the result"


def test_errors_carry_name_value_and_traceback(sbx):
    seen = []
    execution = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=seen.append)
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "f()" in execution.error.traceback and "ZeroDivisionError" in execution.error.traceback
    assert [e.name for e in seen] == ["ZeroDivisionError"]
    # The kernel goes on.
    assert sbx.run_code("x").text == "42"


def test_matplotlib_gives_a_png_and_a_chart(sbx):
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [4, 5, 6], label='line')\n"
        "plt.title('growth')\n"
        "plt.show()"
    )
    assert execution.error is None, execution.error
    figures = [r for r in execution.results if r.png]
    assert len(figures) == 1
    assert base64.b64decode(figures[0].png).startswith(PNG_MAGIC)
    chart = figures[0].chart
    assert chart is not None and chart.title == "growth"
    assert chart.elements[0].points == [(1.0, 4.0), (2.0, 5.0), (3.0, 6.0)]


PIL_IMAGE = (
    "import numpy\n"
    "from PIL import Image\n"
    "imarray = numpy.random.rand(16, 16, 3) * 255\n"
    "image = Image.fromarray(imarray.astype('uint8')).convert('RGBA')\n"
)


@pytest.mark.parametrize(
    ("shown", "main"),
    [
        ("image.show()\nprint('Image shown.')", False),
        ("display(image)", False),
        ("image.save('test.png')\nprint('Image saved.')", False),
        ("image", True),
    ],
)
def test_pil_images_give_a_png(sbx, shown, main):
    execution = sbx.run_code(PIL_IMAGE + shown)
    assert execution.error is None, execution.error
    image = execution.results[0]
    assert base64.b64decode(image.png).startswith(PNG_MAGIC)
    assert image.is_main_result is main


BOX_PLOT = """
import matplotlib.pyplot as plt

data = {
    'Class A': [85, 90, 78, 92, 88],
    'Class B': [95, 89, 76, 91, 84, 87],
    'Class C': [75, 82, 88, 79, 86]
}
fig, ax = plt.subplots(figsize=(10, 6))
ax.set_title('Exam Scores Distribution')
ax.set_xlabel('Class')
ax.set_ylabel('Score')
ax.boxplot(data.values(), labels=data.keys(), patch_artist=True)
plt.tight_layout()
plt.show()
"""


def test_a_box_and_whisker_chart_is_extracted(sbx):
    chart = sbx.run_code(BOX_PLOT).results[0].chart
    assert chart is not None
    assert chart.type == ChartType.BOX_AND_WHISKER
    assert (chart.title, chart.x_label, chart.y_label) == ("Exam Scores Distribution", "Class", "Score")
    boxes = chart.elements
    assert [b.label for b in boxes] == ["Class A", "Class B", "Class C"]
    assert [b.min for b in boxes] == [78, 84, 75]
    assert [b.first_quartile for b in boxes] == [85, 84.75, 79]
    assert [b.median for b in boxes] == [88, 88, 82]
    assert [b.third_quartile for b in boxes] == [90, 90.5, 86]
    assert [b.max for b in boxes] == [92, 95, 88]
    assert [b.outliers for b in boxes] == [[], [76], []]


def _chart_of(sbx, *lines: str):
    """The chart of the first result of `lines` of pyplot code, run between
    `import matplotlib.pyplot as plt` and `plt.show()`."""
    return sbx.run_code("\n".join(["import matplotlib.pyplot as plt", *lines, "plt.show()"])).results[0].chart


def test_bar_pie_scatter_and_super_charts_are_extracted(sbx):
    bar = _chart_of(sbx, "plt.bar(['A', 'B', 'C'], [100, 200, 300], label='Sold')", "plt.title('Sales')")
    assert bar.type == ChartType.BAR and bar.title == "Sales"
    assert [(b.label, b.value, b.group) for b in bar.elements] == [
        ("A", 100, "Sold"),
        ("B", 200, "Sold"),
        ("C", 300, "Sold"),
    ]
    pie = _chart_of(
        sbx, "fig, ax = plt.subplots()", "ax.pie([90, 10], labels=['No', 'Yes'], startangle=90)", "plt.title('Early?')"
    )
    assert pie.type == ChartType.PIE and pie.title == "Early?"
    assert [(p.label, p.angle, p.radius) for p in pie.elements] == [("No", 324, 1), ("Yes", 36, 1)]
    scatter = _chart_of(sbx, "plt.scatter([1, 2, 3], [3, 2, 1], label='points')", "plt.xlabel('A')")
    assert scatter.type == ChartType.SCATTER and scatter.x_label == "A"
    assert scatter.elements[0].label == "points"
    assert scatter.elements[0].points == [(1.0, 3.0), (2.0, 2.0), (3.0, 1.0)]
    both = _chart_of(
        sbx,
        "fig, axs = plt.subplots(1, 2)",
        "fig.suptitle('Two')",
        "axs[0].plot([1, 2], [3, 4])",
        "axs[0].set_title('Line')",
        "axs[1].scatter([1, 2], [3, 4])",
        "axs[1].set_title('Dots')",
    )
    assert both.type == ChartType.SUPERCHART and both.title == "Two"
    assert [(c.type, c.title) for c in both.elements] == [
        (ChartType.LINE, "Line"),
        (ChartType.SCATTER, "Dots"),
    ]


def test_lists_and_dicts_give_json(sbx):
    result = sbx.run_code("import numpy\n{'a': [1, 2], 3: numpy.int64(4)}").results[0]
    assert result.json == {"a": [1, 2], "3": 4}
    assert sbx.run_code("[1, 'two']").results[0].json == [1, "two"]


def test_dataframes_latex_and_json(sbx):
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    result = frame.results[0]
    assert result.is_main_result
    assert result.data == {"a": [1, 2], "b": ["x", "y"]}
    assert "<table" in result.html
    rich = sbx.run_code(
        "from IPython.display import JSON, Latex, display\n"
        "display(Latex(r'$\\alpha^2$'))\n"
        "JSON({'k': [1, 2]})"
    )
    latex, json_result = rich.results
    assert latex.latex == "$\\alpha^2$" and not latex.is_main_result
    assert json_result.json == {"k": [1, 2]} and json_result.is_main_result


def test_the_data_libraries_are_there(sbx):
    execution = sbx.run_code(
        "import numpy, pandas, scipy, sklearn, matplotlib\n"
        "from sklearn.linear_model import LinearRegression\n"
        "from scipy import stats\n"
        "model = LinearRegression().fit([[0], [1], [2]], [1, 3, 5])\n"
        "round(float(model.coef_[0]), 3), round(float(stats.norm.cdf(0)), 3)"
    )
    assert execution.error is None, execution.error
    assert execution.text == "(2.0, 0.5)"


def test_bash_keeps_its_cwd_and_variables(sbx):
    sbx.run_code("cd /tmp && COUNT=5", language="bash")
    execution = sbx.run_code("echo $COUNT; pwd", language="bash")
    assert execution.error is None
    assert "".join(execution.logs.stdout) == "5\n/tmp\n"


def test_environment_variables(sbx):
    assert sbx.run_code("import os\nos.environ['GLOBAL_VAR']").text == "from-create"
    once = sbx.run_code("os.environ.get('CALL_VAR')", envs={"CALL_VAR": "only-now"})
    assert once.text == "only-now"
    assert sbx.run_code("os.environ.get('CALL_VAR', 'gone')").text == "gone"
    shadowed = sbx.run_code("os.environ['GLOBAL_VAR']", envs={"GLOBAL_VAR": "shadow"})
    assert shadowed.text == "shadow"
    assert sbx.run_code("os.environ['GLOBAL_VAR']").text == "from-create"
    bash = sbx.run_code(
        "echo \"$GLOBAL_VAR $CALL_VAR\"", language="bash", envs={"CALL_VAR": "it's bash"}
    )
    assert bash.logs.stdout == ["from-create it's bash\n"]
    after = sbx.run_code("echo \"[${CALL_VAR-unset}]\"", language="bash")
    assert after.logs.stdout == ["[unset]\n"]


def test_javascript_results_output_await_imports_and_state(sbx):
    assert sbx.run_code("1 + 1", language="js").text == "2"
    logged = sbx.run_code("console.log('from node')\nlet kept = 40", language="javascript")
    assert logged.error is None and logged.results == []
    assert logged.logs.stdout == ["from node\n"]
    assert sbx.run_code("kept + 2", language="js").text == "42"
    awaited = sbx.run_code(
        "await new Promise((resolve) => setTimeout(() => resolve(kept + 1), 50))", language="js"
    )
    assert awaited.text == "41"
    imported = sbx.run_code(
        'import * as path from "node:path"\npath.basename("/a/b.txt").length', language="js"
    )
    assert imported.error is None and imported.text == "5"
    assert sbx.run_code("path.extname('x.md')", language="js").text == ".md"


def test_typescript_runs_typed_code(sbx):
    typed = sbx.run_code(
        "function add(a: number, b: number): number {\n  return a + b\n}\n"
        "const start: number = 40\nadd(start, 2)",
        language="ts",
    )
    assert typed.error is None and typed.text == "42"
    assert sbx.run_code("add(start, 1)", language="typescript").text == "41"
    # tslab's compiler checks the types: a mismatch is an error, and nothing ran.
    wrong = sbx.run_code("const label: string = 1", language="ts")
    assert wrong.error.name == "TSError"
    assert "not assignable to type 'string'" in wrong.error.value


def test_r_results_output_and_data_frames(sbx):
    assert sbx.run_code("1 + 1", language="r").results[0].text == "[1] 2"
    printed = sbx.run_code('print("hi")\ncat("plain\\n")\nkept <- 5', language="r")
    assert printed.error is None
    assert printed.logs.stdout == ['[1] "hi"\n', "plain\n"]
    assert sbx.run_code("kept * 2", language="r").results[0].text == "[1] 10"
    frame = sbx.run_code('data.frame(a = 1:2, b = c("x", "y"))', language="r").results[0]
    assert "<table" in frame.html and "<td>x</td>" in frame.html
    assert frame.text.splitlines()[0].split() == ["a", "b"]


def test_java_results_output_and_state(sbx):
    assert sbx.run_code("int x = 40;", language="java", timeout=60).error is None
    out = sbx.run_code('System.out.println("from java");\nx + 2', language="java")
    assert out.logs.stdout == ["from java\n"]
    assert out.text == "42"


def test_errors_from_each_language(sbx):
    js = sbx.run_code('throw new TypeError("bad thing")', language="js")
    assert (js.error.name, js.error.value) == ("TypeError", "bad thing")
    assert "TypeError: bad thing" in js.error.traceback
    assert "kernel.js" not in js.error.traceback
    r = sbx.run_code('stop("bad thing")', language="r")
    assert r.error.name == "ERROR" and "bad thing" in r.error.value
    assert 'stop("bad thing")' in r.error.traceback
    java = sbx.run_code('throw new IllegalStateException("bad thing");', language="java")
    assert "IllegalStateException" in java.error.value and "bad thing" in java.error.value
    assert "IllegalStateException" in java.error.traceback
    # Each kernel goes on with its state.
    assert sbx.run_code("kept", language="js").text == "40"
    assert sbx.run_code("kept", language="r").results[0].text == "[1] 5"
    assert sbx.run_code("x", language="java").text == "40"


@pytest.mark.parametrize(
    ("language", "read", "unset"),
    [
        (
            "js",
            "console.log(`${process.env.GLOBAL_VAR} ${process.env.CALL_VAR}`)",
            "console.log(process.env.CALL_VAR ?? 'gone')",
        ),
        (
            "ts",
            "console.log(`${process.env.GLOBAL_VAR} ${process.env.CALL_VAR}`)",
            "console.log(process.env.CALL_VAR ?? 'gone')",
        ),
        (
            "r",
            'cat(Sys.getenv("GLOBAL_VAR"), Sys.getenv("CALL_VAR"))',
            'cat(Sys.getenv("CALL_VAR", unset = "gone"))',
        ),
    ],
)
def test_environment_variables_in_other_languages(sbx, language, read, unset):
    def shown(code, **envs):
        execution = sbx.run_code(code, language=language, envs=envs or None)
        assert execution.error is None, execution.error
        return "".join(execution.logs.stdout).strip()

    assert shown(read.replace("CALL_VAR", "GLOBAL_VAR")) == "from-create from-create"
    assert shown(read, CALL_VAR="it's \"now\"\n$HOME") == "from-create it's \"now\"\n$HOME"
    assert shown(unset) == "gone"
    assert shown(read, GLOBAL_VAR="shadow", CALL_VAR="x") == "shadow x"
    assert shown(read.replace("CALL_VAR", "GLOBAL_VAR")) == "from-create from-create"


def test_java_environment_variables(sbx):
    # As E2B's server does, the variables are system properties too: its own tests read them
    # with System.getProperty.
    def shown(code, **envs):
        execution = sbx.run_code(code, language="java", envs=envs or None)
        assert execution.error is None, execution.error
        return execution.text

    both = 'System.getenv("{0}") + " " + System.getProperty("{0}")'
    assert shown(both.format("GLOBAL_VAR")) == "from-create from-create"
    assert shown(both.format("FOO"), FOO="bar") == "bar bar"
    assert shown('System.getenv("FOO") + " " + System.getProperty("FOO", "default")') == (
        "null default"
    )
    assert shown(both.format("GLOBAL_VAR"), GLOBAL_VAR="overwrite") == "overwrite overwrite"
    assert shown(both.format("GLOBAL_VAR")) == "from-create from-create"
    # Quotes, backslashes and newlines as given.
    value = "it's \"q\"\\n\n$HOME"
    assert shown('System.getenv("FOO").equals(System.getProperty("FOO"))', FOO=value) == "true"
    assert shown('System.getenv("FOO")', FOO=value) == value
    # The kernel's state went on through all of it.
    assert shown("x") == "40"


def test_a_context_per_language(sbx):
    cases = [
        ("js", "javascript", "process.cwd()", lambda e: e.text, "/tmp"),
        ("ts", "typescript", "process.cwd()", lambda e: e.text, "/tmp"),
        ("r", "r", "getwd()", lambda e: e.results[0].text, '[1] "/tmp"'),
        ("java", "java", 'System.getProperty("user.dir")', lambda e: e.text, "/tmp"),
    ]
    for language, canonical, code, show, expected in cases:
        ctx = sbx.create_code_context(language=language, cwd="/tmp")
        try:
            assert ctx.language == canonical
            assert show(sbx.run_code(code, context=ctx, timeout=60)) == expected, language
            # Its own kernel: the default context's state is not there.
            assert sbx.run_code("kept", context=ctx).error is not None, language
        finally:
            sbx.remove_code_context(ctx)


@pytest.mark.parametrize(
    ("language", "code", "kept"),
    [
        ("js", "while (true) {}", "kept"),
        ("r", "Sys.sleep(60)", "kept"),
        ("java", "Thread.sleep(60000);", "x"),
    ],
)
def test_a_timeout_interrupts_the_other_kernels(sbx, language, code, kept):
    with pytest.raises(TimeoutException):
        sbx.run_code(code, language=language, timeout=2)
    # Interrupted (SIGINT, or for Java an interrupt_request): the kernel answers at once and
    # kept its state.
    started = time.monotonic()
    after = sbx.run_code(kept, language=language, timeout=10)
    assert after.error is None, after.error
    assert time.monotonic() - started < 5
    assert (after.text or after.results[0].text) in ("40", "[1] 5")


def test_an_unknown_language_is_refused(sbx):
    with pytest.raises(SandboxException, match="400 Bad Request: language 'cobol' is not supported"):
        sbx.run_code("1", language="cobol")


def test_contexts_are_independent(sbx):
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"
    sbx.run_code("only_here = 1", context=ctx)
    assert sbx.run_code("only_here").error.name == "NameError"
    assert sbx.run_code("x", context=ctx).error.name == "NameError"
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}

    sbx.restart_code_context(ctx)
    assert sbx.run_code("only_here", context=ctx).error.name == "NameError"
    assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"

    bash_ctx = sbx.create_code_context(language="bash", cwd="/")
    assert sbx.run_code("pwd", context=bash_ctx).logs.stdout == ["/\n"]
    sbx.remove_code_context(bash_ctx)

    sbx.remove_code_context(ctx.id)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)
    with pytest.raises(InvalidArgumentException):
        sbx.run_code("1", context=ctx, language="python")


def test_kernels_run_as_root_in_home_user(sbx):
    # The default bash context went to /tmp in an earlier test: a new one starts in the
    # default directory too.
    bash = sbx.create_code_context(language="bash")
    cases = [
        ({"language": "python"}, "import os\nprint(os.getuid(), os.getcwd())"),
        ({"context": bash}, "echo $(id -u) $(pwd)"),
        ({"language": "js"}, "console.log(process.getuid(), process.cwd())"),
        ({"language": "r"}, 'cat(Sys.info()[["effective_user"]], getwd(), "\\n")'),
    ]
    for language, code in cases:
        execution = sbx.run_code(code, **language)
        assert execution.error is None, (language, execution.error)
        assert "".join(execution.logs.stdout).split() in (
            ["0", "/home/user"],
            ["root", "/home/user"],
        ), language
    sbx.remove_code_context(bash)
    java = sbx.run_code('System.getProperty("user.name") + " " + System.getProperty("user.dir")', language="java")
    assert java.text == "root /home/user"
    # What E2B's own test does: a context in root's home.
    ctx = sbx.create_code_context(language="python", cwd="/root")
    try:
        assert sbx.list_code_contexts()[-1].id == ctx.id
        assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "/root"
    finally:
        sbx.remove_code_context(ctx)


def test_files_a_kernel_writes_stay_usable_by_user(sbx):
    sbx.run_code("open('/home/user/from-kernel.txt', 'w').write('kernel')")
    try:
        # Root's, readable by all (umask 022) as on E2B; the user reads it, and may remove it
        # from their home.
        owner = sbx.commands.run("stat -c '%U %a' /home/user/from-kernel.txt")
        assert owner.stdout.strip() == "root 644"
        assert sbx.files.read("/home/user/from-kernel.txt") == "kernel"
        assert sbx.commands.run("cat /home/user/from-kernel.txt").stdout == "kernel"
        # And the other way round: what the user writes, the kernel reads.
        sbx.files.write("/home/user/from-user.txt", "user")
        assert sbx.run_code("open('/home/user/from-user.txt').read()").text == "user"
    finally:
        sbx.commands.run("rm -f /home/user/from-kernel.txt /home/user/from-user.txt")
    assert sbx.commands.run("ls /home/user").stdout.split().count("from-kernel.txt") == 0


def test_default_contexts_of_every_language_are_listed_before_their_kernels_start(
    sandbar, interpreter_template
):
    sandbox = Sandbox.create(timeout=120)
    try:
        contexts = sandbox.list_code_contexts()
        languages = [c.language for c in contexts]
        assert languages[:2] == ["python", "javascript"], languages
        assert set(languages) == {"python", "javascript", "typescript", "r", "java", "bash"}
        assert {c.cwd for c in contexts} == {"/home/user"}
        # Listed, not started: an idle sandbox runs the Python kernel only.
        running = sandbox.commands.run("ps -eo args", user="root").stdout
        assert "ipykernel" in running
        for other in ("kernel.js", "IRkernel", "jjava", "bash_kernel"):
            assert other not in running, running
        # A language's first execution runs in its listed context; a Java kernel's first
        # output is there however soon the execution follows its start.
        hello = sandbox.run_code('System.out.println("Hello, World!")', language="java", timeout=60)
        assert hello.error is None, hello.error
        assert hello.logs.stdout == ["Hello, World!\n"]
        assert [c.id for c in sandbox.list_code_contexts()] == [c.id for c in contexts]
        # A context just created is the last of the list, with what it was created with.
        created = sandbox.create_code_context()
        last = sandbox.list_code_contexts()[-1]
        assert (last.id, last.language, last.cwd) == (created.id, "python", "/home/user")
        sandbox.remove_code_context(created)
        assert created.id not in [c.id for c in sandbox.list_code_contexts()]
    finally:
        Sandbox.kill(sandbox.sandbox_id)


def test_a_kernel_that_exits_is_replaced(sbx):
    ctx = sbx.create_code_context()
    try:
        sbx.run_code("lost = 1", context=ctx)
        died = sbx.run_code("import os\nos._exit(3)", context=ctx, timeout=30)
        assert died.error is not None and died.error.name == "KernelDied"
        # The next execution gets a new kernel: the context goes on, its state does not.
        assert sbx.run_code("1 + 1", context=ctx).text == "2"
        assert sbx.run_code("lost", context=ctx).error.name == "NameError"
    finally:
        sbx.remove_code_context(ctx)


def test_the_wire_refuses_context_and_language_together(sbx):
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49999",
        "X-Access-Token": sbx._envd_access_token,
    }
    url = sbx.connection_config.get_sandbox_url(sbx.sandbox_id, sbx.sandbox_domain, port=49999)
    both = httpx.post(
        f"{url}/execute",
        json={"code": "1", "context_id": "x", "language": "python"},
        headers=headers,
        timeout=30,
    )
    assert both.status_code == 400
    unknown = httpx.post(
        f"{url}/execute", json={"code": "1", "context_id": "nope"}, headers=headers, timeout=30
    )
    assert unknown.status_code == 404
    assert httpx.get(f"{url}/health", headers=headers, timeout=30).status_code == 200


def test_a_timeout_interrupts_the_execution(sbx):
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(60)\nleft = True", timeout=2)
    assert time.monotonic() - started < 10
    # The client's hang-up interrupted the sleep: the kernel answers at once, and the line
    # after it never ran.
    deadline = time.monotonic() + 10
    after = sbx.run_code("'left' in globals()", timeout=10)
    assert after.text == "False"
    assert time.monotonic() < deadline


def test_connect_sees_the_same_kernel(sbx):
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.run_code("x").text == "42"


def test_pause_and_resume_keep_variables(sandbar, interpreter_template):
    # Restored from the template's capture where the server can, then paused and resumed.
    sandbox = Sandbox.create(timeout=120)
    try:
        sandbox.run_code("kept = [1, 2, 3]")
        assert sandbox.pause() is True
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=120)
        assert resumed.run_code("sum(kept)").text == "6"
        assert resumed.run_code("kept.append(4)\nsum(kept)").text == "10"
    finally:
        Sandbox.kill(sandbox.sandbox_id)


def _interpreter(sandbar, sandbox, path: str, token, body=None) -> httpx.Response:
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49999"}
    if token is not None:
        headers["X-Access-Token"] = token
    if body is None:
        return httpx.get(sandbar.url + path, headers=headers, timeout=10)
    return httpx.post(sandbar.url + path, headers=headers, json=body, timeout=30)


def test_executions_need_the_access_token(sandbar, sbx):
    # What the SDKs send with an execution, checked at the edge: it runs code as the agent's
    # process calls do.
    code = {"code": "'ran'"}
    for token in (None, "not-the-token", sbx._envd_access_token[:-1]):
        r = _interpreter(sandbar, sbx, "/execute", token, code)
        assert r.status_code == 401, (token, r.status_code, r.text)
        assert "access token" in r.json()["message"]
    ran = _interpreter(sandbar, sbx, "/execute", sbx._envd_access_token, code)
    assert ran.status_code == 200 and '"text":"ran"' in ran.text, ran.text
    # The SDKs send no token with the contexts' calls (nor with /health).
    assert _interpreter(sandbar, sbx, "/contexts", None).status_code == 200
    assert _interpreter(sandbar, sbx, "/health", None).status_code == 200


def _identity(sandbox) -> dict:
    execution = sandbox.run_code(
        "import json, os, random, numpy\n"
        "print(json.dumps({\n"
        "    'boot_id': open('/proc/sys/kernel/random/boot_id').read(),\n"
        "    'machine_id': open('/etc/machine-id').read(),\n"
        "    'random': random.random(),\n"
        "    'numpy': int(numpy.random.randint(1 << 30)),\n"
        "    'urandom': os.urandom(8).hex(),\n"
        "    'env': os.environ.get('ONLY_HERE'),\n"
        "    'leak': 'leak' in globals(),\n"
        "}))"
    )
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout))


def test_sandboxes_restored_from_the_capture_share_no_state(sandbar, interpreter_template):
    if reason := checkpoints_off(sandbar):
        pytest.skip(f"no capture without CRIU: {reason}")
    first = Sandbox.create(timeout=120, envs={"ONLY_HERE": "first"})
    second = Sandbox.create(timeout=120, envs={"ONLY_HERE": "second"})
    try:
        # Restored with the kernel already running: nothing was executed in it before.
        assert first.run_code("1").execution_count == 1
        first.run_code("leak = 'first'")
        a, b = _identity(first), _identity(second)
        assert (a["env"], a["leak"], b["env"], b["leak"]) == ("first", True, "second", False), (a, b)
        # Each its own machine, and Python's and numpy's generators seeded again after the
        # restore: the capture's seeds would give both the same numbers.
        for field in ("boot_id", "machine_id", "random", "numpy", "urandom"):
            assert a[field] != b[field], (field, a, b)
        assert first.run_code("'leak' in globals()").text == "True"
        assert second.run_code("'leak' in globals()").text == "False"
        # The server's own ids after the restore come from the kernel's entropy.
        assert first.create_code_context().id != second.create_code_context().id
        # The bash kernel starts after the restore and gets the sandbox's variables too.
        assert second.run_code("echo $ONLY_HERE", language="bash").logs.stdout == ["second\n"]
    finally:
        Sandbox.kill(first.sandbox_id)
        Sandbox.kill(second.sandbox_id)


def test_a_snapshot_keeps_the_kernel_state(sandbar, interpreter_template):
    require_checkpoints(sandbar, "snapshot memory")
    source = Sandbox.create(timeout=120)
    copy = None
    try:
        source.run_code("kept = {'n': 7}")
        snapshot = source.create_snapshot()
        copy = Sandbox.create(snapshot.snapshot_id, timeout=120)
        assert copy.run_code("kept['n'] * 6").text == "42"
        assert copy.run_code("kept['n'] = 1\nkept['n']").text == "1"
        assert source.run_code("kept['n']").text == "7"
        assert copy.pause() is True
        resumed = Sandbox.connect(copy.sandbox_id, timeout=120)
        assert resumed.run_code("kept['n'] + 1").text == "2"
    finally:
        for sandbox in (source, copy):
            if sandbox is not None:
                Sandbox.kill(sandbox.sandbox_id)


def test_the_npm_sdk(sandbar, interpreter_template):
    from e2e_util import JS_DIR, run_node_test

    assert (JS_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir(), (
        f"the npm code interpreter SDK is not installed: run `npm ci --prefix {JS_DIR}`"
    )
    run_node_test(sandbar, "code_interpreter.test.mjs")
