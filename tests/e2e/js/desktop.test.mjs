// The official npm Desktop SDK (@e2b/desktop) against a running Sandbar server's built-in
// `desktop` template. Run by tests/e2e/test_desktop.py, which sets E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from '@e2b/desktop';
import { CommandExitError } from 'e2b';

const PNG_MAGIC = [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a];

// Width and height from a PNG's IHDR chunk.
function pngSize(bytes) {
  assert.deepEqual([...bytes.subarray(0, 8)], PNG_MAGIC);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  return [view.getUint32(16), view.getUint32(20)];
}

// Retries `check` until it gives a true value; a command that fails meanwhile (xdotool
// finding no window yet) counts as not yet.
async function until(check, what, timeoutMs = 15_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    let value;
    try {
      value = await check();
    } catch (err) {
      if (!(err instanceof CommandExitError)) throw err;
    }
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`${what} did not hold within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 300));
  }
}

test('the desktop SDK drives the screen, keyboard, files and stream', async () => {
  const desktop = await Sandbox.create({ resolution: [1024, 768], dpi: 96, timeoutMs: 300_000 });
  try {
    assert.deepEqual(await desktop.getScreenSize(), { width: 1024, height: 768 });
    const shot = await desktop.screenshot();
    assert.deepEqual(pngSize(shot), [1024, 768]);

    await desktop.launch('xfce4-terminal');
    const windows = await until(
      async () => (await desktop.getApplicationWindows('xfce4-terminal')).filter(Boolean).length > 0,
      'a terminal window',
    );
    assert.ok(windows);
    await until(async () => {
      const focused = await desktop.getCurrentWindowId();
      return (await desktop.getApplicationWindows('xfce4-terminal')).includes(focused);
    }, 'the terminal has the focus');
    await desktop.write('echo typed-from-js > /tmp/typed-js.txt');
    await desktop.press('enter');
    const text = await until(
      async () => (await desktop.files.exists('/tmp/typed-js.txt')) && desktop.files.read('/tmp/typed-js.txt'),
      "the typed command's file",
    );
    assert.equal(text, 'typed-from-js\n');

    await desktop.moveMouse(200, 300);
    assert.deepEqual(await desktop.getCursorPosition(), { x: 200, y: 300 });
    await desktop.leftClick();
    await desktop.doubleClick(210, 310);

    await desktop.stream.start({ requireAuth: true });
    const key = await desktop.stream.getAuthKey();
    const url = desktop.stream.getUrl({ authKey: key });
    assert.ok(url.startsWith(`https://6080-${desktop.sandboxId}.`), url);
    assert.ok(url.includes(`password=${key}`), url);
    const page = await desktop.commands.run('curl -sf http://127.0.0.1:6080/vnc.html');
    assert.match(page.stdout, /noVNC/);
    await desktop.stream.stop();
  } finally {
    await desktop.kill();
  }
});
