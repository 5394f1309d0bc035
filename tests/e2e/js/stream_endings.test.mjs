// A sandbox that goes away while the npm SDK streams a command's output. Run by
// tests/e2e/test_js_sdk.py, which sets E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox, TimeoutError } from 'e2b';

// Prints a line a second for half a minute: the stream is open long after the kill.
const TICKER = 'for i in $(seq 30); do echo tick $i; sleep 1; done';

// The edge's end-of-stream message (code unavailable), then what the SDK adds to it; a cut
// stream was "[unknown] terminated: …" instead.
function assertNotRunning(err, sandboxId) {
  assert.ok(err instanceof TimeoutError, `${err?.constructor?.name}: ${err?.message}`);
  const expected =
    '[unavailable] The sandbox was not found: the sandbox was killed or reached its end of life ' +
    `(sandbox '${sandboxId}'): ` +
    'This error is likely due to sandbox timeout.';
  assert.ok(err.message.startsWith(expected), err.message);
  return true;
}

async function killQuietly(sandboxId) {
  await Sandbox.kill(sandboxId).catch(() => {});
}

test('a kill from another client ends a foreground command with the SDK error', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 60_000 });
  try {
    const seen = [];
    let killer;
    const run = sbx.commands.run(TICKER, {
      timeoutMs: 0,
      onStdout: (line) => {
        seen.push(line);
        killer ??= Sandbox.kill(sbx.sandboxId);
      },
    });
    await assert.rejects(run, (err) => assertNotRunning(err, sbx.sandboxId));
    assert.equal(await killer, true);
    assert.equal(seen[0], 'tick 1\n');
  } finally {
    await killQuietly(sbx.sandboxId);
  }
});

test("a kill from another client ends a background command's wait", async () => {
  const sbx = await Sandbox.create({ timeoutMs: 60_000 });
  try {
    const handle = await sbx.commands.run(TICKER, { background: true, timeoutMs: 0 });
    for (let i = 0; i < 50 && !handle.stdout.includes('tick 1'); i++) await new Promise((r) => setTimeout(r, 100));
    assert.ok(handle.stdout.includes('tick 1'), 'the ticker runs');
    assert.equal(await Sandbox.kill(sbx.sandboxId), true);
    await assert.rejects(handle.wait(), (err) => assertNotRunning(err, sbx.sandboxId));
  } finally {
    await killQuietly(sbx.sandboxId);
  }
});

test("the end of a sandbox's timeout ends its streams the same way", async () => {
  const sbx = await Sandbox.create({ timeoutMs: 3_000 });
  try {
    await assert.rejects(sbx.commands.run(TICKER, { timeoutMs: 0 }), (err) => assertNotRunning(err, sbx.sandboxId));
  } finally {
    await killQuietly(sbx.sandboxId);
  }
});
