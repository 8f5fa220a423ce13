// The pacer: at most N slots out at once, handed on in order.
import assert from "node:assert/strict";
import { test } from "node:test";

import { Pacer } from "../src/pace.js";

test("Pacer: at most limit holders, the rest wait in order", async () => {
  const p = new Pacer(2);
  let active = 0;
  let most = 0;
  const order = [];
  const work = async (i) => {
    const release = await p.acquire();
    active++;
    most = Math.max(most, active);
    order.push(i);
    await new Promise((r) => setTimeout(r, 5));
    active--;
    release();
    release(); // twice gives back one slot
  };
  await Promise.all(Array.from({ length: 7 }, (_, i) => work(i)));
  assert.equal(most, 2);
  assert.deepEqual(order, [0, 1, 2, 3, 4, 5, 6]);
  assert.equal(p.waiting, 0);
  const a = await p.acquire();
  const b = await p.acquire();
  let third = false;
  const c = p.acquire().then((r) => {
    third = true;
    return r;
  });
  await new Promise((r) => setTimeout(r, 5));
  assert.equal(third, false, "a third waits while two are out");
  a();
  (await c)();
  b();
});

test("Pacer: a limit must be a whole number of at least one", () => {
  for (const bad of [0, -1, 1.5, NaN]) {
    assert.throws(() => new Pacer(bad), RangeError, `${bad}`);
  }
});
