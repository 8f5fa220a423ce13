// The journal (IndexedDB) and the client's retry loop, in a real browser against
// a real HTTP server: the repository's Go test test/browserclient serves this page
// and a scripted endpoint, runs it in headless Chromium and reads window.idemTests.
//
// The scripted endpoint: POST /script/NAME with a JSON list of answers
// ({status, retryAfter, location, delayMs, body}) queues them; each request to
// /do/NAME takes the next one (200 {"ok":true} when none is left) and is
// recorded; GET /seen/NAME lists the Idempotency-Key of every request it got,
// GET /requests/NAME what it saw of each, GET /inflight/NAME the most it had in
// flight at once. The page's query names another origin (`other`), serving the
// same endpoint with the CORS configuration set by POST /cors/MODE ("none",
// "preflight", "full"), and an origin where nothing listens (`down`).

import { Client, IntentGoneError, JournalUnavailableError } from "../../src/idem.js";
import { Journal } from "../../src/journal.js";

const params = new URLSearchParams(location.search);
const otherOrigin = params.get("other") ?? "";
const downOrigin = params.get("down") ?? "";

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

/** @param {string} name */
function wipe(name) {
  return new Promise((resolve, reject) => {
    const del = indexedDB.deleteDatabase(name);
    del.onsuccess = resolve;
    del.onerror = () => reject(del.error);
  });
}

/** A client whose journal is wiped after each response arrives, before it reads it. */
function wipingClient(name) {
  return new Client({
    journal: name, ...still,
    fetch: async (url, init) => {
      const res = await fetch(url, init);
      await wipe(name);
      return res;
    },
  });
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
async function requests(name) {
  return (await fetch(`/requests/${name}`)).json();
}
function record(key, over = {}) {
  return { key, owner: "", scope: "", method: "POST", url: `${location.origin}/do/x`, body: "{}", createdAt: Date.now(), attempts: 0, status: "pending", ...over };
}
const fast = { backoffBase: 1, backoffMax: 10, timeout: 2000 };
/** fast, and no re-drive: a round's outcome stays as it is. */
const still = { ...fast, redrive: false };
/** Waits for cond, every 20 ms, up to ms. */
async function eventually(what, cond, ms = 10_000) {
  const end = performance.now() + ms;
  for (;;) {
    if (await cond()) {
      return;
    }
    if (performance.now() > end) {
      throw new Error(`timed out waiting for ${what}`);
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}
const done = { status: "done", httpStatus: 202, code: "", response: "{}", replayed: false, lastError: "" };

// --- the journal ----------------------------------------------------------------

test("journal: append, get, all of an owner oldest first, pending", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("b", { createdAt: 2000 }));
  await j.append(record("a", { createdAt: 1000 }));
  await j.append(record("c", { createdAt: 3000, status: "done" }));
  await j.append(record("x", { createdAt: 500, owner: "someone else" }));
  equal((await j.get("a"))?.createdAt, 1000, "get");
  equal(await j.get("nope"), undefined, "get unknown");
  equal((await j.all("")).map((r) => r.key), ["a", "b", "c"], "all");
  equal((await j.pending("")).map((r) => r.key), ["a", "b"], "pending");
  equal((await j.all("someone else")).map((r) => r.key), ["x"], "another owner's");
  await rejects(j.append(record("a")), null, "append of a key the journal holds");
  equal((await j.get("a"))?.createdAt, 1000, "the first record stays");
  j.close();
});

test("journal: attempts are counted; a finished intent is not; an unknown one is gone", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("k"));
  equal((await j.recordAttempt("k", 5)).attempts, 1, "first");
  const second = await j.recordAttempt("k", 7);
  equal([second.attempts, second.lastAttemptAt], [2, 7], "second");
  await j.finish("k", done, false);
  const fin = await j.recordAttempt("k", 9);
  equal([fin.status, fin.attempts], ["done", 2], "finished: unchanged");
  const e = await rejects(j.recordAttempt("other", 1), IntentGoneError, "unknown key");
  equal(e.key, "other", "the error names the key");
  j.close();
});

test("journal: the first final answer stays; the body and the response go unless kept", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("k", { body: '{"card_token":"tok_1"}', headers: { "X-Test": "1" } }));
  const a = await j.finish("k", { ...done, response: "first", code: "" }, false);
  const b = await j.finish("k", { ...done, status: "rejected", httpStatus: 422, response: "second", code: "x" }, false);
  equal([a.first, a.rec.status, a.rec.httpStatus, b.first, b.rec.status, b.rec.httpStatus], [true, "done", 202, false, "done", 202], "finish twice");
  const kept = await j.get("k");
  equal([kept.body, kept.headers, kept.response, kept.key, kept.httpStatus], [undefined, undefined, undefined, "k", 202], "what a finished intent keeps");
  assert(kept.finishedAt > 0, "finishedAt");
  await j.append(record("keep", { body: "{}" }));
  await j.finish("keep", { ...done, response: "the answer" }, true);
  equal([(await j.get("keep")).body, (await j.get("keep")).response], ["{}", "the answer"], "kept when asked");
  await rejects(j.finish("other", done, false), IntentGoneError, "unknown key");
  j.close();
});

test("journal: prune drops old finished intents and stale pending ones, of every owner", async () => {
  const j = new Journal(fresh("j"));
  const now = 1_000_000;
  await j.append(record("old-done", { status: "done", finishedAt: 1000 }));
  await j.append(record("old-rejected", { status: "rejected", finishedAt: 1000, owner: "bob" }));
  await j.append(record("new-done", { status: "done", finishedAt: 5000 }));
  await j.append(record("young-pending", { createdAt: now - 100 }));
  await j.append(record("stale-pending", { createdAt: now - 600, owner: "alice" }));
  await j.append(record("future-pending", { createdAt: now + 600 }));
  equal(await j.prune({ finishedBefore: 2000, now, staleAfter: 500 }), 4, "pruned");
  equal((await j.all("")).map((r) => r.key).sort(), ["new-done", "young-pending"], "left");
  j.close();
});

test("journal: forget and clear delete only the owner's intents", async () => {
  const j = new Journal(fresh("j"));
  await j.append(record("a1", { owner: "alice" }));
  await j.append(record("a2", { owner: "alice", status: "done" }));
  await j.append(record("b1", { owner: "bob" }));
  equal(await j.forget("b1", "alice"), false, "alice cannot forget bob's");
  equal(await j.forget("a1", "alice"), true, "her own");
  equal(await j.clear("alice"), ["a2"], "clear");
  equal((await j.all("bob")).map((r) => r.key), ["b1"], "bob's stays");
  j.close();
});

test("journal: a journal of the first schema is upgraded, its intents owned by their scope", async () => {
  const name = fresh("j");
  await new Promise((resolve, reject) => {
    const req = indexedDB.open(name, 1);
    req.onupgradeneeded = () => {
      const store = req.result.createObjectStore("intents", { keyPath: "key" });
      store.createIndex("createdAt", "createdAt");
      const { owner: _, ...old } = record("v1", { scope: "tenant-a" });
      store.add(old);
    };
    req.onsuccess = () => {
      req.result.close();
      resolve();
    };
    req.onerror = () => reject(req.error);
  });
  const c = new Client({ journal: name, ...still, scope: "tenant-a" });
  equal((await c.list()).map((r) => r.key), ["v1"], "the scope's client sees it");
  equal((await new Client({ journal: name, ...still }).list()).length, 0, "an unscoped one does not");
  c.close();
});

test("journal: a deletion elsewhere is not blocked, and the journal starts afresh", async () => {
  const name = fresh("j");
  const j = new Journal(name);
  await j.append(record("k"));
  // As the page's "wipe the journal", or the user clearing the site's data: the
  // open connection must let go, or the deletion would wait for ever.
  await wipe(name);
  await rejects(j.recordAttempt("k", 1), IntentGoneError, "after the wipe");
  equal(await j.all(""), [], "a fresh journal");
  j.close();
});

test("journal: storage that cannot be used is a JournalUnavailableError, saying why; nothing is sent", async () => {
  const s = fresh("s");
  const open = indexedDB.open;
  const add = IDBObjectStore.prototype.add;
  try {
    indexedDB.open = () => {
      throw new DOMException("The user denied permission to access the database.", "SecurityError");
    };
    const c = new Client({ journal: fresh("c"), ...still });
    const e = await rejects(c.submit({ path: `/do/${s}`, body: "{}" }), JournalUnavailableError, "open throws");
    assert(/does not allow storage/.test(e.reason) && e.cause?.name === "SecurityError", `${e.reason} / ${e.cause}`);
    indexedDB.open = open;
    IDBObjectStore.prototype.add = function () {
      throw new DOMException("", "QuotaExceededError");
    };
    const q = await rejects(new Client({ journal: fresh("c"), ...still }).submit({ path: `/do/${s}`, body: "{}" }), JournalUnavailableError, "quota");
    assert(/storage for this site is full/.test(q.message), q.message);
  } finally {
    indexedDB.open = open;
    IDBObjectStore.prototype.add = add;
  }
  equal(await seen(s), [], "nothing sent");
});

// --- the client -----------------------------------------------------------------

test("client: the intent is on disk before the first request leaves", async () => {
  const name = fresh("c");
  const s = fresh("s");
  let journaled = null;
  const c = new Client({
    journal: name, ...still, keepResponses: true,
    fetch: async (url, init) => {
      const key = new Headers(init.headers).get("Idempotency-Key");
      journaled = await new Journal(name).get(key);
      return fetch(url, init);
    },
  });
  const r = await c.submit({ path: `/do/${s}`, body: { a: 1 } });
  assert(journaled !== null, "the journal held the intent when fetch was called");
  equal([journaled.key, journaled.attempts, journaled.body, journaled.method], [r.key, 1, '{"a":1}', "POST"], "the journaled intent");
  equal([r.status, r.httpStatus, r.attempts, r.response], ["done", 200, 1, { ok: true }], "result");
  equal(await seen(s), [r.key], "sent once");
  c.close();
});

test("client: a finished intent's body and response leave the journal; the result still has the response", async () => {
  const name = fresh("c");
  const s = fresh("s");
  await script(s, [{ status: 201, body: '{"id":"pay_1"}' }]);
  const c = new Client({ journal: name, ...still });
  const r = await c.submit({ path: `/do/${s}`, body: { account: "acct_1", payment_method: "pm_tok" } });
  equal([r.status, r.httpStatus, r.response], ["done", 201, { id: "pay_1" }], "result");
  const rec = await new Journal(name).get(r.key);
  equal([rec.status, rec.httpStatus, rec.body, rec.response], ["done", 201, undefined, undefined], "journaled");
  equal((await c.status(r.key)).response, undefined, "status: no response kept");
  c.close();
});

test("client: 503 with Retry-After is retried with the same key, after the server's wait", async () => {
  const s = fresh("s");
  await script(s, [{ status: 503, retryAfter: "1" }]);
  const c = new Client({ journal: fresh("c"), backoffBase: 1, backoffMax: 5000, redrive: false });
  const t0 = performance.now();
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  const took = performance.now() - t0;
  equal([r.status, r.attempts], ["done", 2], "result");
  equal(await seen(s), [r.key, r.key], "the same key twice");
  assert(took >= 1000, `waited ${took} ms, want at least the Retry-After of 1 s`);
  c.close();
});

test("client: a Retry-After longer than backoffMax pauses the intent until then, then it is sent", async () => {
  const s = fresh("s");
  await script(s, [{ status: 503, retryAfter: "2" }]);
  const events = [];
  const c = new Client({ journal: fresh("c"), backoffBase: 1, backoffMax: 100, onEvent: (e) => events.push(e) });
  const t0 = Date.now();
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.attempts, r.cause], ["pending", 1, "http"], "paused after one attempt");
  assert(r.retryAt >= t0 + 2000 && r.retryAt <= t0 + 3000, `retryAt ${r.retryAt - t0} ms after the send, want the server's 2 s`);
  const paused = events.find((e) => e.type === "paused");
  equal(paused?.retryAt, r.retryAt, "the paused event says when");
  await eventually("the re-drive sending it", async () => (await c.status(r.key))?.status === "done");
  assert(Date.now() - t0 >= 2000, "not before the server's wait");
  equal(await seen(s), [r.key, r.key], "the same key twice");
  c.close();
});

// (408 is left to the Node test of retryable: Chromium itself re-sends a request
// answered 408 on a reused connection, so the page would not see it.)
test("client: timeout, network error, 5xx, 409 in progress, 425 and 429 are retried with the same key", async () => {
  const s = fresh("s");
  await script(s, [{ status: 200, delayMs: 6000 }, { status: 500 }, { status: 502 }, { status: 409, body: '{"code":"idempotency_key_in_use"}' },
    { status: 425 }, { status: 429 }]);
  let calls = 0;
  const c = new Client({
    journal: fresh("c"), ...still, timeout: 2000, maxAttempts: 12,
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

test("client: a 409 that is the application's answer is final; shouldRetry overrides the rule", async () => {
  const s = fresh("s");
  await script(s, [{ status: 409, body: '{"code":"order_exists"}' }, { status: 409, retryAfter: "0" }, { status: 404 }]);
  const c = new Client({ journal: fresh("c"), ...still, shouldRetry: (a) => (a.status === 404 ? true : undefined) });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.httpStatus, r.code, r.attempts], ["rejected", 409, "order_exists", 1], "a business 409");
  const r2 = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r2.status, r2.attempts], ["done", 3], "a 409 with Retry-After, then a 404 that shouldRetry retries, then 200");
  c.close();
});

test("client: 422 and other 4xx are final, with the server's code and a message chosen by it", async () => {
  const s = fresh("s");
  await script(s, [
    { status: 422, body: '{"error":"this Idempotency-Key was already used","code":"idempotency_key_mismatch"}' },
    { status: 400, body: '{"error":{"code":"card_declined","message":"Your card was declined."}}' },
    { status: 403, contentType: "application/problem+json", body: '{"type":"https://example.com/probs/out-of-credit","title":"You do not have enough credit."}' },
  ]);
  const c = new Client({ journal: fresh("c"), ...still });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.httpStatus, r.attempts, r.code], ["rejected", 422, 1, "idempotency_key_mismatch"], "422");
  assert(/different request/.test(r.error), `422 explained: ${r.error}`);
  equal(r.response, { error: "this Idempotency-Key was already used", code: "idempotency_key_mismatch" }, "the response, parsed");
  const r2 = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r2.status, r2.httpStatus, r2.code], ["rejected", 400, "card_declined"], "a nested code");
  assert(/Your card was declined/.test(r2.error), r2.error);
  const r3 = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r3.code, (await c.status(r3.key)).code], ["https://example.com/probs/out-of-credit", "https://example.com/probs/out-of-credit"], "a problem's type, kept in the journal");
  equal(await seen(s), [r.key, r2.key, r3.key], "one request each");
  equal((await c.resume()).length, 0, "nothing left to resume");
  c.close();
});

test("client: a key refused for its age on a clock 50 h behind is the same intent, sent again under a key of the server's clock", async () => {
  const s = fresh("s");
  await script(s, [{ status: 422, body: '{"error":"this Idempotency-Key was minted 50h0m0s ago","code":"idempotency_key_expired"}' }]);
  const events = [];
  const c = new Client({ journal: fresh("c"), ...still, onEvent: (e) => events.push(e) });
  const real = Date.now;
  const behind = 50 * 3600 * 1000;
  Date.now = () => real() - behind;
  let r;
  try {
    r = await c.submit({ path: `/do/${s}`, body: '{"amount_cents":100}' });
  } finally {
    Date.now = real;
  }
  const keys = await seen(s);
  equal([r.status, r.previousKey, keys.length, keys[0], keys[1]], ["done", keys[0], 2, r.previousKey, r.key], "done under a second key");
  const minted = (k) => parseInt(k.slice(0, 8) + k.slice(9, 13), 16);
  assert(Math.abs(minted(r.key) - real()) < 5 * 60 * 1000, `the new key is dated by the server's clock: ${new Date(minted(r.key)).toISOString()}`);
  assert(Math.abs(minted(r.previousKey) - (real() - behind)) < 5 * 60 * 1000, "the first by the device's");
  const rekeyed = events.find((e) => e.type === "rekeyed");
  assert(rekeyed && rekeyed.previousKey === r.previousKey && /clock is about 50 h behind/.test(rekeyed.error), JSON.stringify(rekeyed));
  equal((await c.list()).map((x) => [x.key, x.status]), [[r.key, "done"]], "one intent in the journal");
  c.close();
});

test("client: a key refused for its age that this page did not mint stays rejected, the clock named", async () => {
  const s = fresh("s");
  const name = fresh("c");
  await script(s, [{ status: 422, body: '{"code":"idempotency_key_expired"}' }]);
  const j = new Journal(name);
  await j.append(record("from-an-earlier-page", { url: `${location.origin}/do/${s}` }));
  j.close();
  const c = new Client({ journal: name, ...still });
  const [r] = await c.resume();
  equal([r.status, r.code, r.previousKey], ["rejected", "idempotency_key_expired", ""], "rejected");
  assert(/clock/.test(r.error), r.error);
  equal(await seen(s), ["from-an-earlier-page"], "sent once, not re-keyed");
  c.close();
});

test("client: without re-driving, a round that ends pending says so: no delay on its last failure, then exhausted", async () => {
  const s = fresh("s");
  await script(s, [{ status: 503 }, { status: 503 }]);
  const name = fresh("c");
  const events = [];
  const c = new Client({ journal: name, ...still, maxAttempts: 2, onEvent: (e) => events.push(e) });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.attempts, r.retryAt, r.cause], ["pending", 2, 0, "http"], "after two 503s");
  assert(/HTTP 503/.test(r.error), r.error);
  const tail = events.filter((e) => e.key === r.key).map((e) => `${e.type}${e.delay !== undefined ? "+delay" : ""}`);
  equal(tail, ["journaled", "sending", "failed+delay", "sending", "failed", "exhausted"], "events");
  c.close();
  const later = new Client({ journal: name, ...still });
  const [again] = await later.resume();
  equal([again.key, again.status, again.attempts], [r.key, "done", 3], "resumed");
  equal(await seen(s), [r.key, r.key, r.key], "one key");
  equal((await later.status(r.key))?.status, "done", "status");
  later.close();
});

test("client: a page left open keeps sending a pending intent until it is done: every failure with a delay is followed", async () => {
  const s = fresh("s");
  await script(s, Array(7).fill({ status: 503 }));
  const events = [];
  const c = new Client({ journal: fresh("c"), backoffBase: 1, backoffMax: 20, redriveMax: 40, timeout: 2000, maxAttempts: 2, onEvent: (e) => events.push(e) });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.attempts], ["pending", 2], "the round ends pending");
  assert(r.retryAt > 0, "with a time for the next attempt");
  await eventually("the open page finishing it", async () => (await c.status(r.key))?.status === "done");
  const keys = await seen(s);
  equal([keys.length, keys.every((k) => k === r.key)], [8, true], "eight sends, one key");
  const mine = events.filter((e) => e.key === r.key);
  for (let i = 0; i < mine.length; i++) {
    if (mine[i].type === "failed" && mine[i].delay !== undefined) {
      equal(mine[i + 1]?.type, "sending", `event ${i + 1} after a failure with a delay`);
    }
    if (mine[i].type === "failed" && mine[i].delay === undefined) {
      equal(mine[i + 1]?.type, "paused", `event ${i + 1} after a round's last failure`);
    }
  }
  equal(mine.at(-1).type, "finished", "the last event");
  c.close();
});

test("client: the re-drive gives up at the key lifetime, with an expired event, and sends nothing after", async () => {
  const s = fresh("s");
  await script(s, Array(100).fill({ status: 503 }));
  const events = [];
  const c = new Client({ journal: fresh("c"), backoffBase: 1, backoffMax: 20, redriveMax: 40, maxAttempts: 1, keyLifetime: 400, onEvent: (e) => events.push(e) });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  await eventually("expired", () => events.some((e) => e.type === "expired" && e.key === r.key));
  const sent = (await seen(s)).length;
  await new Promise((res) => setTimeout(res, 300));
  equal([(await seen(s)).length, (await c.status(r.key)).status], [sent, "expired"], "nothing sent after");
  c.close();
});

test("client: retry(key) sends a paused intent now; focus, pageshow and online do too", async () => {
  const s = fresh("s");
  await script(s, [{ status: 503 }, { status: 503 }]);
  const c = new Client({ journal: fresh("c"), backoffBase: 1, backoffMax: 10_000, redriveMax: 60_000, maxAttempts: 1 });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  assert(r.status === "pending" && r.retryAt - Date.now() > 4000, "paused for seconds");
  const again = await c.retry(r.key);
  equal([again.status, again.attempts, again.httpStatus], ["pending", 2, 0], "retried at once: another 503");
  window.dispatchEvent(new Event("focus"));
  await eventually("focus sending it", async () => (await c.status(r.key))?.status === "done", 3000);
  equal(await seen(s), [r.key, r.key, r.key], "one key");
  equal(await c.retry("unknown"), undefined, "an unknown key");
  c.close();
});

test("client: owners: resume sends only the owner's intents; list, status, forget and clear see only them", async () => {
  const s = fresh("s");
  const name = fresh("c");
  const j = new Journal(name);
  await j.append(record("alice-1", { owner: "alice", scope: "alice", url: `${location.origin}/do/${s}`, body: '{"account":"acct_alice"}' }));
  await j.append(record("bob-1", { owner: "bob", scope: "bob", url: `${location.origin}/do/${s}` }));
  j.close();
  const bob = new Client({ journal: name, ...still, scope: "bob" });
  const rs = await bob.resume();
  equal(rs.map((r) => [r.key, r.status]), [["bob-1", "done"]], "bob's resume");
  equal(await seen(s), ["bob-1"], "alice's intent was not sent under bob's session");
  equal((await bob.list()).map((r) => r.key), ["bob-1"], "bob's list");
  equal([await bob.status("alice-1"), await bob.forget("alice-1"), await bob.retry("alice-1")], [undefined, false, undefined], "alice's, to bob");
  equal(await bob.clear(), 1, "bob signs out");
  equal(await bob.list(), [], "nothing of bob's left");
  const alice = new Client({ journal: name, ...still, scope: "alice" });
  const [ra] = await alice.resume();
  equal([ra.key, ra.status], ["alice-1", "done"], "alice's, when she is back");
  equal((await requests(s)).map((q) => q.key), ["bob-1", "alice-1"], "each once");
  bob.close();
  alice.close();
});

test("client: a redirect is not followed; the intent stays pending", async () => {
  const s = fresh("s");
  const elsewhere = fresh("s");
  await script(s, [{ status: 302, location: `/do/${elsewhere}` }]);
  const c = new Client({ journal: fresh("c"), ...still });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.attempts, r.cause], ["pending", 1, "redirect"], "result");
  assert(/redirect/.test(r.error), r.error);
  equal(await seen(elsewhere), [], "not followed");
  c.close();
});

test("client: two clients resuming one intent send it once, and the one that waited hears it finished", async () => {
  const s = fresh("s");
  await script(s, [{ status: 202, delayMs: 1000 }]);
  const name = fresh("c");
  const j = new Journal(name);
  await j.append(record("shared", { url: `${location.origin}/do/${s}` }));
  j.close();
  const events = [];
  const a = new Client({ journal: name, ...still, onEvent: (e) => events.push(`a:${e.type}${e.otherTab ? "(other)" : ""}`) });
  const b = new Client({ journal: name, ...still, onEvent: (e) => events.push(`b:${e.type}${e.otherTab ? "(other)" : ""}`) });
  const [ra, rb] = await Promise.all([a.resume(), b.resume()]);
  equal([ra[0].status, rb[0].status, ra[0].attempts, rb[0].attempts], ["done", "done", 1, 1], "both see it done");
  equal(await seen(s), ["shared"], "sent once");
  const waiter = events.includes("b:waiting") ? "b" : "a";
  const sender = waiter === "b" ? "a" : "b";
  assert(events.includes(`${waiter}:waiting`), `one waited: ${events}`);
  await eventually("the waiter hearing it", () => events.includes(`${waiter}:finished(other)`));
  equal(events.filter((e) => e.startsWith(`${waiter}:finished`)).length, 1, `one finished event for the waiter: ${events}`);
  assert(events.includes(`${waiter}:sending(other)`) && events.includes(`${sender}:finished`), `the waiter heard the sender's steps: ${events}`);
  a.close();
  b.close();
});

test("client: two submits are two intents", async () => {
  const s = fresh("s");
  const c = new Client({ journal: fresh("c"), ...still });
  const [r1, r2] = await Promise.all([c.submit({ path: `/do/${s}`, body: "{}" }), c.submit({ path: `/do/${s}`, body: "{}" })]);
  assert(r1.key !== r2.key, "two keys");
  equal((await seen(s)).sort(), [r1.key, r2.key].sort(), "two requests");
  c.close();
});

test("client: an intent wiped before its final answer is gone, not re-minted, with its last answer", async () => {
  const name = fresh("c");
  const s = fresh("s");
  await script(s, [{ status: 503, body: '{"code":"database_unavailable"}' }]);
  const c = wipingClient(name);
  const e = await rejects(c.submit({ path: `/do/${s}`, body: "{}" }), IntentGoneError, "submit");
  equal([e.httpStatus, e.response], [503, { code: "database_unavailable" }], "the last answer it got");
  equal((await seen(s)).length, 1, "no retry, no new key");
  c.close();
});

test("client: a final answer that arrives after the journal was wiped is kept as the outcome", async () => {
  const name = fresh("c");
  const s = fresh("s");
  await script(s, [{ status: 202, body: '{"payment_id":7}' }]);
  const c = wipingClient(name);
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.httpStatus, r.response], ["done", 202, { payment_id: 7 }], "done, from the answer in hand");
  assert(/left the journal/.test(r.error), r.error);
  c.close();
});

test("client: resume prunes finished intents past pruneAfter, and expired ones past it", async () => {
  const name = fresh("c");
  const j = new Journal(name);
  await j.append(record("old", { status: "done", finishedAt: Date.now() - 10_000 }));
  await j.append(record("recent", { status: "done", finishedAt: Date.now() }));
  await j.append(record("long-expired", { createdAt: Date.now() - 20_000 }));
  await j.append(record("just-expired", { createdAt: Date.now() - 6000 }));
  j.close();
  const c = new Client({ journal: name, ...still, pruneAfter: 5000, keyLifetime: 5000 });
  await c.resume();
  equal((await c.list()).map((r) => [r.key, r.status]), [["just-expired", "expired"], ["recent", "done"]], "left");
  c.close();
});

test("client: resume sends at most `concurrency` at once, and the timeout counts from the send", async () => {
  const s = fresh("s");
  const name = fresh("c");
  await script(s, Array(6).fill({ status: 202, delayMs: 700 }));
  const j = new Journal(name);
  for (let i = 0; i < 6; i++) {
    await j.append(record(`p${i}`, { url: `${location.origin}/do/${s}`, createdAt: Date.now() + i }));
  }
  j.close();
  // Six sends of 700 ms two at a time take 2.1 s; each must still fit a 1.2 s
  // timeout, which it would not if its wait for a slot counted.
  const c = new Client({ journal: name, ...still, concurrency: 2, timeout: 1200 });
  const rs = await c.resume();
  equal(rs.map((r) => [r.status, r.attempts]), Array(6).fill(["done", 1]), "each done at its first attempt");
  equal(await (await fetch(`/inflight/${s}`)).json(), 2, "at most two in flight at the server, and two");
  c.close();
});

test("client: request headers and a content type are sent with every attempt; the headers option is asked afresh and not journaled", async () => {
  const s = fresh("s");
  const name = fresh("c");
  await script(s, [{ status: 503 }]);
  let token = 0;
  const c = new Client({ journal: name, ...still, keepResponses: true, headers: () => ({ Authorization: `Bearer t${++token}` }) });
  const r = await c.submit({ path: `/do/${s}`, body: "amount=5", contentType: "application/x-www-form-urlencoded", headers: { "X-Test": "yes" } });
  equal(r.status, "done", "done");
  equal((await requests(s)).map((q) => [q.contentType, q.test, q.authorization, q.body]),
    [["application/x-www-form-urlencoded", "yes", "Bearer t1", "amount=5"], ["application/x-www-form-urlencoded", "yes", "Bearer t2", "amount=5"]], "what the server saw");
  const rec = await new Journal(name).get(r.key);
  equal([rec.headers, JSON.stringify(rec).includes("Bearer")], [{ "X-Test": "yes" }, false], "journaled: the request's headers, no token");
  await rejects(c.submit({ path: `/do/${s}`, headers: { "idempotency-key": "mine" } }), RangeError, "the client's own header");
  c.close();
});

test("client: a CORS failure is told from an outage, and the intent waits, pending, for the fix", async () => {
  assert(otherOrigin && downOrigin, "the harness names the other origins");
  const s = fresh("s");
  const c = new Client({ journal: fresh("c"), ...still, baseURL: otherOrigin, maxAttempts: 1 });
  await fetch("/cors/none", { method: "POST" });
  const r = await c.submit({ path: `/do/${s}`, body: "{}" });
  equal([r.status, r.cause], ["pending", "cors"], "no preflight answered");
  assert(/CORS/.test(r.error) && /Access-Control-Allow-Origin/.test(r.error) && /Idempotency-Key/.test(r.error), r.error);
  equal(await seen(s), [], "nothing ran");
  await fetch("/cors/preflight", { method: "POST" });
  const r2 = await c.retry(r.key);
  equal([r2.status, r2.cause], ["pending", "cors"], "the answer hidden");
  equal(await seen(s), [r.key], "the service ran it");
  await fetch("/cors/full", { method: "POST" });
  const r3 = await c.retry(r.key);
  equal([r3.status, r3.httpStatus], ["done", 200], "fixed: the answer read");
  equal(await seen(s), [r.key, r.key], "the same key");
  const outage = new Client({ journal: fresh("c"), ...still, baseURL: downOrigin, maxAttempts: 1 });
  const r4 = await outage.submit({ path: `/do/${s}`, body: "{}" });
  equal([r4.status, r4.cause], ["pending", "network"], "an outage is no CORS failure");
  assert(/unreachable/.test(r4.error), r4.error);
  c.close();
  outage.close();
});

test("client: coordinated where Web Locks are; persist() answers", async () => {
  const c = new Client({ journal: fresh("c"), ...still });
  equal(c.coordinated, true, "127.0.0.1 is a secure context");
  equal(typeof (await c.persist()), "boolean", "persist");
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
