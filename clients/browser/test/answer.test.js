// Reading a server's answer: its error code, the message chosen by it, its clock.
import assert from "node:assert/strict";
import { test } from "node:test";

import { clockOffset, codeName, corsContract, errorCode, errorMessage, isKeyAgeCode, keyAgeCodes, rejectionMessage } from "../src/answer.js";

test("errorCode: idem's JSON, a nested error object, an RFC 9457 problem", () => {
  assert.equal(errorCode('{"error":"x","code":"idempotency_key_mismatch"}'), "idempotency_key_mismatch");
  assert.equal(errorCode('{"error":{"code":"card_declined","message":"no"}}'), "card_declined");
  const problem = "application/problem+json; charset=utf-8";
  assert.equal(errorCode('{"type":"https://example.com/probs/out-of-credit","title":"t"}', problem), "https://example.com/probs/out-of-credit");
  assert.equal(errorCode('{"type":"https://example.com/p","code":"out_of_credit"}', problem), "out_of_credit", "a code member wins");
  assert.equal(errorCode('{"type":"about:blank","title":"Not Found"}', problem), "", "about:blank names nothing");
  assert.equal(errorCode('{"type":"https://example.com/p"}', "application/json"), "", "a type outside a problem is not a code");
  for (const junk of ["", "not json", "[1]", "null", '{"code":5}', '{"error":"no code"}']) {
    assert.equal(errorCode(junk), "", junk);
  }
});

test("errorMessage: the server's words, bounded", () => {
  assert.equal(errorMessage('{"error":"this key was used","code":"x"}'), "this key was used");
  assert.equal(errorMessage('{"error":{"message":"Your card was declined."}}'), "Your card was declined.");
  assert.equal(errorMessage('{"type":"t","title":"T","detail":"D"}'), "D");
  assert.equal(errorMessage(JSON.stringify({ error: "x".repeat(500) })).length, 203);
  assert.equal(errorMessage("<html>"), "");
});

test("the message is chosen by the code; a key refused for its age names the clock", () => {
  assert.match(rejectionMessage(422, "idempotency_key_mismatch", ""), /different request/);
  assert.match(rejectionMessage(422, "idempotency_key_expired", ""), /clock/);
  assert.doesNotMatch(rejectionMessage(422, "idempotency_key_expired", ""), /different request/);
  assert.match(rejectionMessage(422, "https://example.com/probs/idempotency_key_expired", ""), /clock/, "a problem type, by its last segment");
  const other = rejectionMessage(422, "amount_too_small", "amount must be at least 50");
  assert.match(other, /HTTP 422 amount_too_small/);
  assert.match(other, /amount must be at least 50/);
  assert.doesNotMatch(other, /different request|clock/);
  assert.match(rejectionMessage(400, "", ""), /^HTTP 400: /);
  assert.deepEqual([...keyAgeCodes], ["idempotency_key_expired", "idempotency_key_clock_skew"]);
  assert.equal(isKeyAgeCode("idempotency_key_clock_skew"), true);
  assert.equal(isKeyAgeCode("idempotency_key_expired"), true);
  assert.equal(isKeyAgeCode("idempotency_key_mismatch"), false);
  assert.equal(codeName("https://x.example/a/b/"), "b");
  assert.equal(codeName("plain"), "plain");
});

test("clockOffset: the server's Date against this clock", () => {
  const now = Date.parse("2026-12-01T12:00:00Z");
  assert.equal(clockOffset("Thu, 03 Dec 2026 14:00:00 GMT", now), 50 * 3600 * 1000);
  assert.equal(clockOffset("Tue, 01 Dec 2026 11:59:50 GMT", now), -10_000);
  for (const junk of [null, undefined, "", "yesterday", "1733000000"]) {
    assert.equal(clockOffset(junk, now), null, `${junk}`);
  }
});

test("corsContract: every header a cross-origin page needs", () => {
  const c = corsContract("https://shop.example", "https://api.example");
  for (const part of ["Access-Control-Allow-Origin: https://shop.example", "Idempotency-Key", "Idempotency-Scope", "Content-Type",
    "actual response", "Idempotent-Replayed", "Retry-After", "Date"]) {
    assert.ok(c.includes(part), part);
  }
});
