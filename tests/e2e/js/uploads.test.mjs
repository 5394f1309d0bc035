// Many uploads with the npm SDK while the host's CPUs are busy: every one must succeed. Run by
// tests/e2e/test_js_uploads.py, which starts and stops the CPU burners.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox } from 'e2b';

const UPLOADS = Number(process.env.SANDBAR_UPLOADS ?? 200);

test(`${UPLOADS} uploads under CPU load all succeed`, async () => {
  const sbx = await Sandbox.create({ timeoutMs: 180_000 });
  const failures = [];
  try {
    for (let i = 0; i < UPLOADS; i++) {
      const content = `upload ${i} `.repeat(1 + (i % 50));
      try {
        await sbx.files.write(`/home/user/up/${i % 10}.txt`, content);
      } catch (err) {
        failures.push(`#${i}: ${err?.message ?? err}`);
      }
    }
    assert.equal(await sbx.files.read('/home/user/up/9.txt'), `upload ${UPLOADS - 1} `.repeat(1 + ((UPLOADS - 1) % 50)));
  } finally {
    await sbx.kill();
  }
  assert.deepEqual(failures, [], `${failures.length} of ${UPLOADS} uploads failed`);
});
