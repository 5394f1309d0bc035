// The npm e2b SDK's quick start given only E2B_DOMAIN, E2B_API_KEY and NODE_EXTRA_CA_CERTS: the
// API at https://api.<domain> and the sandbox at https://49983-<id>.<domain>, both on port 443.
// Run by tests/e2e/test_tls.py inside a network namespace where the domain resolves to the
// server's HTTPS listener.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from 'e2b';

test('quick start over HTTPS with only the domain set', async () => {
  for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_DEBUG']) {
    assert.equal(process.env[name], undefined, `${name} must not be set`);
  }
  const domain = process.env.E2B_DOMAIN;
  const marker = `tls-js-${process.pid}-${Date.now()}`;
  const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { suite: marker } });
  // Read by the test, which kills the sandbox should this run end early.
  console.log(JSON.stringify({ created: sbx.sandboxId }));
  try {
    assert.equal(sbx.connectionConfig.apiUrl, `https://api.${domain}`);
    assert.equal(sbx.envdApiUrl, `https://49983-${sbx.sandboxId}.${domain}`);

    const result = await sbx.commands.run('echo hello');
    assert.equal(result.exitCode, 0);
    assert.equal(result.stdout, 'hello\n');

    await sbx.files.write('/tmp/over-https.txt', 'written over https\n');
    assert.equal(await sbx.files.read('/tmp/over-https.txt'), 'written over https\n');

    const listed = await Sandbox.list({ query: { metadata: { suite: marker } } }).nextItems();
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId]);
  } finally {
    await sbx.kill();
  }
  assert.deepEqual(await Sandbox.list({ query: { metadata: { suite: marker } } }).nextItems(), []);
});
