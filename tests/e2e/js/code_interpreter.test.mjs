// The npm code interpreter SDK against the built-in code-interpreter-v1 template. Run by
// tests/e2e/test_code_interpreter.py once the template is built.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from '@e2b/code-interpreter';

test('runCode keeps state, streams output and returns rich results with the npm SDK', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 120_000, envs: { FROM_JS: 'js' } });
  try {
    await sbx.runCode('n = 20');
    const lines = [];
    const execution = await sbx.runCode("import os\nprint(os.environ['FROM_JS'])\nn + 22", {
      onStdout: (m) => lines.push(m.line),
    });
    assert.deepEqual(lines, ['js\n']);
    assert.equal(execution.text, '42');

    const plot = await sbx.runCode('import matplotlib.pyplot as plt\nplt.bar(["a", "b"], [1, 2])\nplt.show()');
    assert.ok(plot.results.some((r) => r.png && r.png.startsWith('iVBOR')));

    const failed = await sbx.runCode('raise ValueError("nope")');
    assert.equal(failed.error.name, 'ValueError');
    assert.equal(failed.error.value, 'nope');

    const ctx = await sbx.createCodeContext({ language: 'bash', cwd: '/tmp' });
    const bash = await sbx.runCode('pwd', { context: ctx });
    assert.deepEqual(bash.logs.stdout, ['/tmp\n']);
    await sbx.removeCodeContext(ctx);
  } finally {
    await sbx.kill();
  }
});
