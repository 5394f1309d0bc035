// Template.build from the official npm e2b SDK against a running Sandbar server. Run by
// tests/e2e/test_js_templates.py, which sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY,
// SANDBAR_E2E_TINY_IMAGE (the busybox image in the local test registry) and
// SANDBAR_E2E_TEMPLATE_NAME (a fresh template name; the wrapper deletes it afterwards).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { BuildError, Sandbox, Template, waitForFile } from 'e2b';

const image = process.env.SANDBAR_E2E_TINY_IMAGE;
const name = process.env.SANDBAR_E2E_TEMPLATE_NAME;

test('build a template from a registry image and start sandboxes from it', async () => {
  assert.ok(image && name, 'SANDBAR_E2E_TINY_IMAGE and SANDBAR_E2E_TEMPLATE_NAME must be set');
  const ctx = mkdtempSync(join(tmpdir(), 'sandbar-js-template-'));
  try {
    writeFileSync(join(ctx, 'hello.txt'), 'hello from js\n');
    mkdirSync(join(ctx, 'dir'));
    writeFileSync(join(ctx, 'dir', 'a.txt'), 'a\n');
    const template = Template({ fileContextPath: ctx })
      .fromImage(image)
      .copy('hello.txt', '/app/hello.txt')
      .copy('dir', '/app/dir')
      .runCmd('echo js-built > /js-built.txt', { user: 'root' })
      .setEnvs({ JS_GREETING: 'hola' })
      .setWorkdir('/app')
      .setUser('user')
      .setStartCmd("sh -c 'echo up > /tmp/js-started; sleep 3600'", waitForFile('/tmp/js-started'));

    const messages = [];
    const info = await Template.build(template, name, { onBuildLogs: (entry) => messages.push(entry.message) });
    assert.ok(info.templateId && info.buildId, JSON.stringify(info));
    const steps = messages.filter((m) => /\[\d+\/\d+\]/.test(m));
    for (const type of ['COPY', 'RUN', 'ENV', 'WORKDIR', 'USER']) {
      assert.ok(
        steps.some((m) => new RegExp(`\\b${type}\\b`).test(m)),
        `no step line for ${type} in:\n${messages.join('\n')}`,
      );
    }
    assert.equal(await Template.exists(name), true);

    const sbx = await Sandbox.create(name, { timeoutMs: 120_000 });
    try {
      const out = async (cmd) => (await sbx.commands.run(cmd)).stdout;
      assert.equal(await out('cat /app/hello.txt /app/dir/a.txt /js-built.txt'), 'hello from js\na\njs-built\n');
      assert.equal(await out('echo $JS_GREETING $FROM_IMAGE'), 'hola tiny\n');
      assert.equal(await out('pwd'), '/app\n');
      assert.equal(await out('whoami'), 'user\n');
      assert.equal(await out('cat /tmp/js-started'), 'up\n');
      assert.match(await out('ps -o pid,args'), /sleep 3600/);
    } finally {
      await sbx.kill();
    }
  } finally {
    rmSync(ctx, { recursive: true, force: true });
  }
});

test('a failing step rejects Template.build with a BuildError', async () => {
  const template = Template().fromImage(image).runCmd('echo js-fail-output; exit 9');
  const messages = [];
  await assert.rejects(
    Template.build(template, `${name}-fail`, { onBuildLogs: (entry) => messages.push(entry.message) }),
    (err) => {
      assert.ok(err instanceof BuildError, `expected BuildError, got ${err}`);
      assert.match(err.message, /\b9\b/);
      return true;
    },
  );
  assert.ok(
    messages.some((m) => m.includes('js-fail-output')),
    `command output missing from the build logs:\n${messages.join('\n')}`,
  );
});
