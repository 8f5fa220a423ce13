// The retry decisions and the backoff, under Node's test runner: pure functions.
import assert from "node:assert/strict";
import { test } from "node:test";

import { backoffDelay, clockSkewAllowanceMs, expiry, inProgressCode, nextStep, parseRetryAfter, redriveDelay, retryable } from "../src/retry.js";

test("retryable: what leaves the outcome open is sent again, answers are not", () => {
  const plain = (status) => ({ status, code: "", retryAfter: false });
  for (const s of [500, 502, 503, 504, 599, 408, 425, 429]) {
    assert.equal(retryable(plain(s)), true, `${s}`);
  }
  for (const s of [200, 201, 202, 204, 400, 401, 403, 404, 409, 410, 413, 422, 451]) {
    assert.equal(retryable(plain(s)), false, `${s}`);
  }
});

test("retryable: a 409 is retried only when the server says the first arrival still runs", () => {
  assert.equal(retryable({ status: 409, code: inProgressCode, retryAfter: false }), true, "the in-progress code");
  assert.equal(retryable({ status: 409, code: "", retryAfter: true }), true, "a Retry-After");
  assert.equal(retryable({ status: 409, code: "order_exists", retryAfter: false }), false, "an application's conflict");
  assert.equal(inProgressCode, "idempotency_key_in_use", "the producer's code");
});

test("parseRetryAfter: seconds, an HTTP-date, and nothing else", () => {
  const now = Date.parse("2026-12-01T12:00:00Z");
  assert.equal(parseRetryAfter("3", now), 3000);
  assert.equal(parseRetryAfter(" 0 ", now), 0);
  assert.equal(parseRetryAfter("Tue, 01 Dec 2026 12:00:05 GMT", now), 5000);
  assert.equal(parseRetryAfter("Tue, 01 Dec 2026 11:59:00 GMT", now), 0, "a date in the past is no hint");
  assert.equal(parseRetryAfter("999999999", now), 24 * 3600 * 1000, "capped at a day");
  for (const junk of [null, undefined, "", "-1", "1.5", "soon", "1 Dec 2030"]) {
    assert.equal(parseRetryAfter(junk, now), 0, `${junk}`);
  }
});

test("backoffDelay: full jitter under a doubling ceiling, capped", () => {
  const shape = { base: 100, max: 1000 };
  const top = () => 0.999999;
  assert.equal(backoffDelay(1, shape, 0, top), 100);
  assert.equal(backoffDelay(2, shape, 0, top), 200);
  assert.equal(backoffDelay(3, shape, 0, top), 400);
  assert.equal(backoffDelay(4, shape, 0, top), 800);
  assert.equal(backoffDelay(5, shape, 0, top), 1000);
  assert.equal(backoffDelay(50, shape, 0, top), 1000, "bounded however many retries");
  assert.equal(backoffDelay(3, shape, 0, () => 0), 0, "full jitter reaches zero");
  for (let n = 1; n < 20; n++) {
    const d = backoffDelay(n, shape);
    assert.ok(d >= 0 && d <= 1000, `retry ${n} waits ${d}`);
  }
});

test("backoffDelay: a Retry-After is the least wait, up to the cap", () => {
  const shape = { base: 100, max: 1000 };
  const low = () => 0;
  assert.equal(backoffDelay(1, shape, 700, low), 700);
  const d = backoffDelay(1, shape, 700, () => 0.5);
  assert.ok(d >= 700 && d <= 800, `${d}: at least the server's wait, plus a little jitter`);
  assert.equal(backoffDelay(1, shape, 60_000, low), 1000, "a Retry-After past the cap waits the cap");
});

test("expiry: past the key lifetime, or of unknown age, is not sent again", () => {
  const day = 24 * 3600 * 1000;
  const now = Date.parse("2026-12-01T12:00:00Z");
  assert.equal(expiry(now, now, day), "");
  assert.equal(expiry(now - day + 1, now, day), "");
  assert.match(expiry(now - day, now, day), /past the key lifetime/);
  assert.equal(expiry(now + clockSkewAllowanceMs, now, day), "", "clock jitter is age zero");
  assert.match(expiry(now + clockSkewAllowanceMs + 1000, now, day), /clock was set back/);
});

test("nextStep: retry within the round, pause when it is spent or the server asks for longer", () => {
  const shape = { base: 100, max: 1000 };
  const top = () => 0.999999;
  assert.deepEqual(nextStep(1, 8, shape, 0, top), { step: "retry", delay: 100 });
  assert.deepEqual(nextStep(7, 8, shape, 0, top), { step: "retry", delay: 1000 });
  assert.deepEqual(nextStep(8, 8, shape, 0, top), { step: "pause", delay: 0 }, "the last attempt has no retry delay");
  assert.deepEqual(nextStep(1, 1, shape, 0, top), { step: "pause", delay: 0 });
  assert.deepEqual(nextStep(2, 8, shape, 800, () => 0), { step: "retry", delay: 800 }, "a Retry-After within the cap");
  assert.deepEqual(nextStep(2, 8, shape, 120_000, top), { step: "pause", delay: 120_000 }, "a long Retry-After is honoured, by a pause");
});

test("redriveDelay: equal jitter under a doubling ceiling, capped: never near zero, never past max", () => {
  const shape = { first: 10_000, max: 30_000 };
  assert.equal(redriveDelay(0, shape, () => 0), 5000);
  assert.equal(redriveDelay(0, shape, () => 0.999999), 10_000);
  assert.equal(redriveDelay(1, shape, () => 0), 10_000);
  assert.equal(redriveDelay(1, shape, () => 0.999999), 20_000);
  assert.equal(redriveDelay(2, shape, () => 0.999999), 30_000);
  assert.equal(redriveDelay(50, shape, () => 0), 15_000);
  for (let p = 0; p < 30; p++) {
    const d = redriveDelay(p, shape);
    assert.ok(d >= 5000 && d <= 30_000, `pause ${p} waits ${d}`);
  }
});
