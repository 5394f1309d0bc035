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

    const js = await sbx.runCode("console.log(process.env.FROM_JS)\nawait Promise.resolve(6 * 7)", {
      language: 'js',
    });
    assert.deepEqual(js.logs.stdout, ['js\n']);
    assert.equal(js.text, '42');
    const ts = await sbx.runCode('const half: number = 21\nhalf * 2', { language: 'ts' });
    assert.equal(ts.text, '42');
    const r = await sbx.runCode('x <- 41\nx + 1', { language: 'r' });
    assert.equal(r.results[0].text, '[1] 42');
    const jsFailed = await sbx.runCode('throw new RangeError("too far")', { language: 'js' });
    assert.equal(jsFailed.error.name, 'RangeError');
    assert.equal(jsFailed.error.value, 'too far');
    const rCtx = await sbx.createCodeContext({ language: 'r', cwd: '/tmp' });
    assert.equal(rCtx.language, 'r');
    const wd = await sbx.runCode('getwd()', { context: rCtx });
    assert.equal(wd.results[0].text, '[1] "/tmp"');
    await sbx.removeCodeContext(rCtx);

    // Every language's default context is listed, the one just created last.
    const listed = (await sbx.listCodeContexts()).map((c) => c.language);
    assert.ok(listed.includes('python') && listed.includes('javascript'), listed.join());
    const ctx = await sbx.createCodeContext({ language: 'bash', cwd: '/tmp' });
    const last = (await sbx.listCodeContexts()).at(-1);
    assert.equal(last.id, ctx.id);
    const bash = await sbx.runCode('pwd', { context: ctx });
    assert.deepEqual(bash.logs.stdout, ['/tmp\n']);
    await sbx.removeCodeContext(ctx);
  } finally {
    await sbx.kill();
  }
});
