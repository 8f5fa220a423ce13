// Keys: UUIDv7, time-ordered, never repeated.
import assert from "node:assert/strict";
import { test } from "node:test";

import { newKey } from "../src/key.js";

const uuidv7 = /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

test("newKey: a UUIDv7 carrying the time", () => {
  const at = Date.parse("2026-12-01T12:00:00.123Z");
  const k = newKey(at);
  assert.match(k, uuidv7);
  const ms = parseInt(k.slice(0, 8) + k.slice(9, 13), 16);
  assert.equal(ms, at);
});

test("newKey: unique, and ordered by time", () => {
  const seen = new Set();
  for (let i = 0; i < 10000; i++) {
    const k = newKey();
    assert.match(k, uuidv7);
    assert.ok(!seen.has(k), `repeated key ${k}`);
    seen.add(k);
  }
  assert.ok(newKey(1000) < newKey(2000));
});
