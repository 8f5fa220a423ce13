// The journal (IndexedDB) and the client's retry loop, in a real browser against
// a real HTTP server: the repository's Go test test/browserclient serves this page
// and a scripted endpoint, runs it in headless Chromium and reads window.idemTests.
//
// The scripted endpoint: POST /script/NAME with a JSON list of answers
// ({status, retryAfter, location, delayMs, body}) queues them; each request to
// /do/NAME takes the next one (200 {"ok":true} when none is left) and is
// recorded; GET /seen/NAME lists the Idempotency-Key of every request it got.

import { Client, IntentGoneError } from "../../src/idem.js";
import { Journal } from "../../src/journal.js";

/** @type {{name: string, ok: boolean, error?: string}[]} */
const results = [];
/** @type {[string, () => Promise<void>][]} */
const tests = [];
const test = (name, fn) => tests.push([name, fn]);

function assert(cond, msg) {
  if (!cond) {
    throw new Error(`assertion failed: ${msg}`);
  }
}
function equal(got, want, msg) {
  const g = JSON.stringify(got);
  const w = JSON.stringify(want);
  if (g !== w) {
    throw new Error(`${msg}: got ${g}, want ${w}`);
  }
}
async function rejects(p, cls, msg) {
  try {
    await p;
  } catch (e) {
    assert(!cls || e instanceof cls, `${msg}: rejected with ${e}, want a ${cls?.name}`);
    return e;
  }
  throw new Error(`${msg}: resolved, want a rejection`);
}

let n = 0;
/** A fresh journal name and script name for one test. */
const fresh = (what) => `${what}-${Date.now()}-${n++}`;

async function script(name, answers) {
  const r = await fetch(`/script/${name}`, { method: "POST", body: JSON.stringify(answers) });
  assert(r.ok, `script ${name}: ${r.status}`);
}
async function seen(name) {
  return (await fetch(`/seen/${name}`)).json();
}
function record(key, over = {}) {
  return { key, scope: "", method: "POST", url: `${location.origin}/do/x`, body: "{}", createdAt: Date.now(), attempts: 0, status: "pending", ...over };
}
const fast = { backoffBase: 1, backoffMax: 10, timeout: 2000 };

// --- the journal ----------------------------------------------------------------

test("journal: append, get, all oldest first, pending", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("b", { createdAt: 2000 }));
  await j.append(record("a", { createdAt: 1000 }));
  await j.append(record("c", { createdAt: 3000, status: "done" }));
  equal((await j.get("a"))?.createdAt, 1000, "get");
  equal(await j.get("nope"), undefined, "get unknown");
  equal((await j.all()).map((r) => r.key), ["a", "b", "c"], "all");
  equal((await j.pending()).map((r) => r.key), ["a", "b"], "pending");
  await rejects(j.append(record("a")), null, "append of a key the journal holds");
  equal((await j.get("a"))?.createdAt, 1000, "the first record stays");
  j.close();
});

test("journal: attempts are counted; a finished intent is not; an unknown one is gone", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("k"));
  equal((await j.recordAttempt("k")).attempts, 1, "first");
  equal((await j.recordAttempt("k")).attempts, 2, "second");
  await j.finish("k", { status: "done", httpStatus: 202, response: "{}", replayed: false });
  const fin = await j.recordAttempt("k");
  equal([fin.status, fin.attempts], ["done", 2], "finished: unchanged");
  const e = await rejects(j.recordAttempt("other"), IntentGoneError, "unknown key");
  equal(e.key, "other", "the error names the key");
  j.close();
});

test("journal: the first final answer stays", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("k"));
  const a = await j.finish("k", { status: "done", httpStatus: 202, response: "first", replayed: false });
  const b = await j.finish("k", { status: "rejected", httpStatus: 422, response: "second", replayed: false });
  equal([a.status, a.response, b.status, b.response], ["done", "first", "done", "first"], "finish twice");
  assert(a.finishedAt > 0, "finishedAt");
  await rejects(j.finish("other", { status: "done", httpStatus: 200, response: "", replayed: false }), IntentGoneError, "unknown key");
  j.close();
});

test("journal: prune drops old finished intents, never pending ones", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("old-done", { status: "done", finishedAt: 1000 }));
  await j.append(record("old-rejected", { status: "rejected", finishedAt: 1000 }));
  await j.append(record("new-done", { status: "done", finishedAt: 5000 }));
  await j.append(record("old-pending", { createdAt: 1 }));
  equal(await j.prune(2000), 2, "pruned");
  equal((await j.all()).map((r) => r.key).sort(), ["new-done", "old-pending"], "left");
  j.close();
});

test("journal: a deletion elsewhere is not blocked, and the journal starts afresh", async () => {
  const name = fresh("j");
  const j = new Journal(name);
  await j.append(record("k"));
  // As the page's "wipe the journal", or the user clearing the site's data: the
  // open connection must let go, or the deletion would wait for ever.
  await new Promise((resolve, reject) => {
    const del = indexedDB.deleteDatabase(name);
    del.onsuccess = resolve;
    del.onerror = () => reject(del.error);
  });
  await rejects(j.recordAttempt("k"), IntentGoneError, "after the wipe");
  equal(await j.all(), [], "a fresh journal");
  j.close();
});

// --- the client -----------------------------------------------------------------

test("client: the intent is on disk before the first request leaves", async () => {
  const name = fresh("c");
  const s = fresh("s");
  let journaled = null;
  const c = new Client({
    journal: name, ...fast,
    fetch: async (url, init) => {
      const key = new Headers(init.headers).get("Idempotency-Key");
      journaled = await new Journal(name).get(key);
      return fetch(url, init);
    },
  });
  const r = await c.submit({ path: `/do/${s}`, body: { a: 1 } });
  assert(journaled !== null, "the journal held the intent when fetch was called");
  equal([journaled.key, journaled.attempts, journaled.body, journaled.method], [r.key, 1, '{"a":1}', "POST"], "the journaled intent");
  equal([r.status, r.httpStatus, r.attempts], ["done", 200, 1], "result");
  equal(await seen(s), [r.key], "sent once");
  c.close();
});

test("client: 503 with Retry-After is retried with the same key, after the server's wait", async () => {
  const s = fresh("s");
  await script(s, [{ status: 503, retryAfter: "1" }]);
  const c = new Client({ journal: fresh("c"), backoffBase: 1, backoffMax: 5000 });
  const t0 = performance.now();
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  const took = performance.now() - t0;
  equal([r.status, r.attempts], ["done", 2], "result");
  equal(await seen(s), [r.key, r.key], "the same key twice");
  assert(took >= 1000, `waited ${took} ms, want at least the Retry-After of 1 s`);
  c.close();
});

// (408 is left to the Node test of retryable: Chromium itself re-sends a request
// answered 408 on a reused connection, so the page would not see it.)
test("client: timeout, network error, 5xx, 409, 425 and 429 are retried with the same key", async () => {
  const s = fresh("s");
  await script(s, [{ status: 200, delayMs: 6000 }, { status: 500 }, { status: 502 }, { status: 409 }, { status: 425 }, { status: 429 }]);
  let calls = 0;
  const c = new Client({
    journal: fresh("c"), ...fast, timeout: 2000, maxAttempts: 12,
    fetch: (url, init) => (calls++ === 1 ? Promise.reject(new TypeError("Failed to fetch")) : fetch(url, init)),
  });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  // Eight attempts: a slow machine may time out one more, which changes nothing.
  equal([r.status, r.httpStatus], ["done", 200], "result");
  assert(r.attempts >= 8, `${r.attempts} attempts, want at least 8`);
  const keys = await seen(s);
  assert(keys.length >= 7 && keys.length <= r.attempts - 1, `${keys.length} requests reached the server (the network error never did)`);
  assert(keys.every((k) => k === r.key), `one key throughout: ${keys}`);
  c.close();
});

test("client: 422 and other 4xx are final: rejected, never re-minted", async () => {
  const s = fresh("s");
  await script(s, [{ status: 422, body: '{"error":{"code":"key_mismatch"}}' }, { status: 400 }]);
  const c = new Client({ journal: fresh("c"), ...fast });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.httpStatus, r.attempts], ["rejected", 422, 1], "422");
  assert(/different request/.test(r.error), `422 explained: ${r.error}`);
  equal(r.response, { error: { code: "key_mismatch" } }, "the response, parsed");
  const r2 = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r2.status, r2.httpStatus, r2.attempts], ["rejected", 400, 1], "400");
  equal(await seen(s), [r.key, r2.key], "one request each");
  equal((await c.resume()).length, 0, "nothing left to resume");
  c.close();
});

test("client: out of attempts the intent stays pending; resume sends the same key", async () => {
  const s = fresh("s");
  await script(s, [{ status: 503 }, { status: 503 }]);
  const name = fresh("c");
  const c = new Client({ journal: name, ...fast, maxAttempts: 2 });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.attempts], ["pending", 2], "after two 503s");
  assert(/still pending/.test(r.error), r.error);
  c.close();
  const later = new Client({ journal: name, ...fast });
  const [again] = await later.resume();
  equal([again.key, again.status, again.attempts], [r.key, "done", 3], "resumed");
  equal(await seen(s), [r.key, r.key, r.key], "one key");
  equal((await later.status(r.key))?.status, "done", "status");
  later.close();
});

test("client: past the key lifetime an intent is expired and never sent", async () => {
  const s = fresh("s");
  const name = fresh("c");
  const j = new Journal(name);
  await j.append(record("old", { url: `${location.origin}/do/${s}`, createdAt: Date.now() - 25 * 3600 * 1000 }));
  await j.append(record("future", { url: `${location.origin}/do/${s}`, createdAt: Date.now() + 3600 * 1000 }));
  j.close();
  const c = new Client({ journal: name, ...fast });
  const rs = await c.resume();
  equal(rs.map((r) => [r.key, r.status]), [["old", "expired"], ["future", "expired"]], "resume");
  assert(/key lifetime/.test(rs[0].error) && /set back/.test(rs[1].error), `${rs[0].error} / ${rs[1].error}`);
  equal((await c.list()).map((r) => r.status), ["expired", "expired"], "list");
  equal(await seen(s), [], "nothing sent");
  c.close();
});

test("client: a redirect is not followed; the intent stays pending", async () => {
  const s = fresh("s");
  const elsewhere = fresh("s");
  await script(s, [{ status: 302, location: `/do/${elsewhere}` }]);
  const c = new Client({ journal: fresh("c"), ...fast });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.attempts], ["pending", 1], "result");
  assert(/redirect/.test(r.error), r.error);
  equal(await seen(elsewhere), [], "not followed");
  c.close();
});

test("client: two clients resuming one intent send it once", async () => {
  const s = fresh("s");
  await script(s, [{ status: 202, delayMs: 1000 }]);
  const name = fresh("c");
  const j = new Journal(name);
  await j.append(record("shared", { url: `${location.origin}/do/${s}` }));
  j.close();
  const events = [];
  const a = new Client({ journal: name, ...fast, onEvent: (e) => events.push(`a:${e.type}`) });
  const b = new Client({ journal: name, ...fast, onEvent: (e) => events.push(`b:${e.type}`) });
  const [ra, rb] = await Promise.all([a.resume(), b.resume()]);
  equal([ra[0].status, rb[0].status, ra[0].attempts, rb[0].attempts], ["done", "done", 1, 1], "both see it done");
  equal(await seen(s), ["shared"], "sent once");
  assert(events.includes("b:waiting") || events.includes("a:waiting"), `one waited: ${events}`);
  a.close();
  b.close();
});

test("client: two submits are two intents", async () => {
  const s = fresh("s");
  const c = new Client({ journal: fresh("c"), ...fast });
  const [r1, r2] = await Promise.all([c.submit({ path: `/do/${s}`, body: "{}" }), c.submit({ path: `/do/${s}`, body: "{}" })]);
  assert(r1.key !== r2.key, "two keys");
  equal((await seen(s)).sort(), [r1.key, r2.key].sort(), "two requests");
  c.close();
});

test("client: an intent wiped while it is sent is gone, not re-minted", async () => {
  const name = fresh("c");
  const s = fresh("s");
  await script(s, [{ status: 503 }]);
  const c = new Client({
    journal: name, ...fast,
    fetch: async (url, init) => {
      const res = await fetch(url, init);
      await new Promise((resolve) => {
        indexedDB.deleteDatabase(name).onsuccess = resolve;
      });
      return res;
    },
  });
  await rejects(c.submit({ path: `/do/${s}`, body: "{}" }), IntentGoneError, "submit");
  equal((await seen(s)).length, 1, "no retry, no new key");
  c.close();
});

test("client: resume prunes finished intents past pruneAfter", async () => {
  const name = fresh("c");
  const j = new Journal(name);
  await j.append(record("old", { status: "done", finishedAt: Date.now() - 10_000 }));
  await j.append(record("recent", { status: "done", finishedAt: Date.now() }));
  j.close();
  const c = new Client({ journal: name, ...fast, pruneAfter: 5000 });
  await c.resume();
  equal((await c.list()).map((r) => r.key), ["recent"], "left");
  c.close();
});

window.idemTests = (async () => {
  for (const [name, fn] of tests) {
    try {
      await fn();
      results.push({ name, ok: true });
    } catch (e) {
      results.push({ name, ok: false, error: String(e?.stack ?? e) });
    }
  }
  document.getElementById("out").textContent = JSON.stringify(results, null, 2);
  return results;
})();
