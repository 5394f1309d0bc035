// The official npm e2b SDK against a running Sandbar server. Run by tests/e2e/test_js_sdk.py,
// which sets E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox, CommandExitError } from 'e2b';

test('create, run commands, move files, list and kill with the JS SDK', async () => {
  const marker = `js-${process.pid}-${Date.now()}`;
  const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { suite: marker }, envs: { GREETING: 'hi' } });
  try {
    const result = await sbx.commands.run('python3 -c "print(6*7)"; echo $GREETING');
    assert.equal(result.exitCode, 0);
    assert.equal(result.stdout, '42\nhi\n');

    await assert.rejects(sbx.commands.run('echo oops >&2; exit 3'), (err) => {
      assert.ok(err instanceof CommandExitError);
      assert.equal(err.exitCode, 3);
      assert.equal(err.stderr, 'oops\n');
      return true;
    });

    await sbx.files.write('/home/user/js/a.txt', 'hello from js');
    assert.equal(await sbx.files.read('/home/user/js/a.txt'), 'hello from js');
    const names = (await sbx.files.list('/home/user/js')).map((e) => e.name);
    assert.deepEqual(names, ['a.txt']);
    assert.equal(await sbx.files.exists('/home/user/js/missing'), false);

    const seen = [];
    const watcher = await sbx.files.watchDir('/home/user/js', (event) => seen.push(event.name));
    await sbx.files.write('/home/user/js/b.txt', 'b');
    for (let i = 0; i < 50 && !seen.includes('b.txt'); i++) await new Promise((r) => setTimeout(r, 100));
    await watcher.stop();
    assert.ok(seen.includes('b.txt'), `watch events: ${JSON.stringify(seen)}`);

    // Gated on envd 0.6.2-0.6.4: file metadata, entries in watch events (the streamed
    // WatchDir, which the Python SDK does not use) and allowing network mounts.
    const withEntries = [];
    const entryWatcher = await sbx.files.watchDir('/home/user/js', (event) => withEntries.push(event), {
      includeEntry: true,
      allowNetworkMounts: true,
    });
    const written = await sbx.files.write('/home/user/js/meta.txt', 'm', { metadata: { Origin: 'js' } });
    assert.deepEqual(written.metadata, { origin: 'js' });
    assert.deepEqual((await sbx.files.getInfo('/home/user/js/meta.txt')).metadata, { origin: 'js' });
    const described = () => withEntries.find((e) => e.name === 'meta.txt' && e.entry?.metadata?.origin === 'js');
    for (let i = 0; i < 50 && !described(); i++) await new Promise((r) => setTimeout(r, 100));
    await entryWatcher.stop();
    const event = described();
    assert.ok(event, `watch events: ${JSON.stringify(withEntries)}`);
    assert.equal(event.entry.path, '/home/user/js/meta.txt');
    assert.equal(event.entry.type, 'file');
    await sbx.files.write('/home/user/js/meta.txt', 'plain');
    assert.equal((await sbx.files.getInfo('/home/user/js/meta.txt')).metadata, undefined);

    const listed = await Sandbox.list({ query: { metadata: { suite: marker } } }).nextItems();
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId]);
    assert.equal(await sbx.isRunning(), true);
  } finally {
    await sbx.kill();
  }
  assert.equal(await sbx.isRunning(), false);
});
