// The client sends intents so that each takes effect once: mint the key on the
// user's act, journal it, then send; every retry, reload and restored tab sends
// that same key again, and a page left open keeps sending it until an answer
// comes or its key lifetime ends.

import { clockOffset, corsContract, errorCode, errorMessage, isKeyAgeCode, rejectionMessage } from "./answer.js";
import { IntentGoneError, Journal } from "./journal.js";
import { newKey } from "./key.js";
import { Pacer } from "./pace.js";
import { clockSkewAllowanceMs, expiry, nextStep, parseRetryAfter, redriveDelay, retryable } from "./retry.js";

/** @typedef {import("./journal.js").IntentRecord} IntentRecord */
/** @typedef {import("./journal.js").FailureCause} FailureCause */
/** @typedef {import("./retry.js").AnswerInfo} AnswerInfo */

/**
 * Where an intent stands, as in package client and `enqueue`'s output: "done" (a
 * 2xx was recorded), "pending" (no final response yet; it is sent again with its
 * key), "rejected" (a final 4xx was recorded) or "expired" (pending, but past the
 * key lifetime or of unknown age: never sent again, reconcile it by hand).
 *
 * @typedef {"pending" | "done" | "rejected" | "expired"} IntentStatus
 */

/**
 * The outcome of one intent.
 *
 * @typedef {object} Result
 * @property {string} key names the intent
 * @property {number} attempts sends with the key, as this browser counts them
 *   (across tabs and reloads); the browser itself may repeat a request after a
 *   broken connection, so the server's count is the one to trust
 * @property {IntentStatus} status
 * @property {number} httpStatus the final response's status; 0 while pending
 * @property {string} code the error code of the final response's body ("" for
 *   none): JSON "code" (or "error.code"), or an RFC 9457 problem's "code" or
 *   "type"
 * @property {unknown} response the final response's body, parsed when it is JSON;
 *   undefined while pending, and once dropped from the journal (keepResponses)
 * @property {boolean} replayed the server answered from its record of the first
 *   arrival (Idempotent-Replayed: true) rather than executing again
 * @property {string} error why the intent needs attention, for a developer or a
 *   log: the last failure of a pending intent, a refusal's reason (chosen by
 *   code), why it expired; "" when none
 * @property {FailureCause} cause why the last attempt got no final answer
 * @property {number} retryAt when this browser sends the pending intent again by
 *   itself, milliseconds since the epoch; 0 when nothing will (offline: it goes
 *   out when the browser is back online; or re-driving is off)
 * @property {string} previousKey the key the intent was first sent with, when the
 *   server refused that key for its age and it was sent again under this one; ""
 * @property {string} method
 * @property {string} url
 * @property {number} createdAt when the intent was journaled, milliseconds since the epoch
 */

/**
 * What happens to an intent, as it happens, for a page to show. Each client
 * also hears what the other tabs' clients of its journal and owner do, marked
 * otherTab.
 *
 * - journaled: the intent is on disk; nothing was sent yet.
 * - waiting: another tab (or call) is sending this intent; this one waits for it.
 * - sending: attempt number `attempt` goes out.
 * - failed: the attempt got no final answer (`error`, `cause`, `httpStatus` when
 *   there was a response). With `delay` (and `retryAt`) the next attempt follows
 *   that much later; without, a paused or exhausted event follows.
 * - paused: the round of attempts ended with the intent pending; the client
 *   sends it again by itself at `retryAt` (sooner when the browser comes back
 *   online, the page is shown again or gets focus, or on retry(key)).
 * - exhausted: the round ended with the intent pending, and nothing in this page
 *   sends it again by itself (re-driving is off, or the client was closed):
 *   resume() or retry(key) does.
 * - offline: the browser is offline; the intent stays pending and is sent when it
 *   is back online.
 * - rekeyed: the server refused the key for its age because this device's clock
 *   is wrong; the same intent goes out again under `key`, its first key
 *   `previousKey` never having taken effect.
 * - finished: a final response was recorded (`httpStatus`, `code`), by another
 *   tab when otherTab.
 * - expired: the intent is past the key lifetime and is not sent again.
 * - gone: the intent is no longer in the journal and is not sent again.
 * - forgotten: forget(key) or clear() deleted the intent.
 *
 * @typedef {object} IntentEvent
 * @property {"journaled" | "waiting" | "sending" | "failed" | "paused" | "exhausted" | "offline" | "rekeyed" | "finished" | "expired" | "gone" | "forgotten"} type
 * @property {string} key
 * @property {number} [attempt]
 * @property {number} [httpStatus]
 * @property {string} [code]
 * @property {number} [delay] milliseconds until the next attempt
 * @property {number} [retryAt] when the next attempt goes out, milliseconds since the epoch
 * @property {string} [error]
 * @property {FailureCause} [cause]
 * @property {string} [previousKey]
 * @property {boolean} [otherTab] another tab's client did this
 */

/**
 * @typedef {object} ClientOptions
 * @property {string} [journal] IndexedDB database of the intents (default "idem").
 *   Clients of one origin that name the same journal share its intents, and
 *   coordinate so that each intent is sent by one of them at a time.
 * @property {string} [owner] whose intents this client sends, lists and forgets:
 *   the signed-in user (default: scope). Each intent is journaled under its
 *   owner; a client never touches another owner's intents.
 * @property {string} [baseURL] what request paths are resolved against (default:
 *   the page's origin). Another origin must follow the CORS contract in the
 *   README.
 * @property {string} [scope] sent as Idempotency-Scope on new intents when not empty
 * @property {number} [maxAttempts] sends per round of submit(), resume() or
 *   retry() (default 8); then the intent is paused, and sent again by the
 *   client's re-drive
 * @property {number} [backoffBase] milliseconds (default 100); see backoffMax
 * @property {number} [backoffMax] milliseconds (default 10000). Retry n of a
 *   round waits a random time up to min(backoffMax, backoffBase·2^(n-1)), or at
 *   least a server's Retry-After; a Retry-After longer than backoffMax pauses the
 *   intent until then.
 * @property {boolean} [redrive] keep sending paused intents while the page is
 *   open: one attempt at a time, redriveMax apart at most, and at once when the
 *   browser comes back online, the page is shown again or gets focus (default
 *   true)
 * @property {number} [redriveMax] milliseconds (default 30000): the wait between
 *   the re-drive's attempts starts near backoffMax and doubles up to this
 * @property {number} [concurrency] requests resume() and the re-drive have on
 *   the wire at once (default 4, below the six connections a browser opens to
 *   one host); submit() and retry() are sent at once
 * @property {number} [timeout] milliseconds one attempt may take from the moment
 *   it is sent, response body included (default 10000)
 * @property {number} [keyLifetime] milliseconds a pending intent is sent again,
 *   counted from its creation (default 24 h, as package client's
 *   DefaultKeyLifetime). It must be shorter than the server's key lifetimes.
 * @property {number} [pruneAfter] milliseconds a finished intent is kept after its
 *   response, and an expired one after its key lifetime (default 7 days);
 *   resume() prunes older ones
 * @property {boolean} [keepResponses] keep a finished intent's body, headers and
 *   response in the journal until it is pruned (default false: dropped when it
 *   finishes; its key, status, HTTP status and code stay)
 * @property {() => Record<string, string> | Promise<Record<string, string>>} [headers]
 *   headers added to every attempt, asked afresh each time and never journaled:
 *   an Authorization or a CSRF token
 * @property {RequestCredentials} [credentials] the fetch credentials mode
 *   (default "same-origin"; "include" sends cookies to another origin)
 * @property {(a: AnswerInfo) => boolean | undefined} [shouldRetry] decides
 *   whether an answer leaves the outcome open (true: sent again with the key) or
 *   is final (false); undefined falls back to the default (5xx, 408, 425, 429,
 *   and 409 with the in-progress code or a Retry-After)
 * @property {typeof fetch} [fetch] sends the requests (default: the global fetch)
 * @property {(e: IntentEvent) => void} [onEvent] told what happens to each intent
 */

/** The defaults of ClientOptions, in milliseconds where a duration. */
export const defaults = Object.freeze({
  journal: "idem",
  maxAttempts: 8,
  backoffBase: 100,
  backoffMax: 10_000,
  redriveMax: 30_000,
  concurrency: 4,
  timeout: 10_000,
  keyLifetime: 24 * 60 * 60 * 1000,
  pruneAfter: 7 * 24 * 60 * 60 * 1000,
});

/**
 * One request to submit as a new intent.
 *
 * @typedef {object} SubmitRequest
 * @property {string} path resolved against baseURL, e.g. "/v1/payments"
 * @property {string} [method] default "POST"
 * @property {unknown} [body] a string is sent as it is; anything else as its
 *   JSON. Every attempt sends the same bytes: the server rejects a key reused
 *   with a different body (422). It is journaled in IndexedDB, readable by any
 *   script of the origin: never card numbers or other secrets (send a token).
 * @property {string} [contentType] the body's Content-Type (default
 *   "application/json")
 * @property {Record<string, string>} [headers] the request's own headers,
 *   journaled with it and sent with every attempt: no secrets (see
 *   ClientOptions.headers)
 */

/** Headers the client sets itself, which a request may not name. */
const ownHeaders = ["idempotency-key", "idempotency-scope", "content-type", "accept"];

/** How long a CORS diagnosis of an origin holds, milliseconds. */
const diagnosisTTL = 30_000;

/**
 * Milliseconds by which a re-drive's timer may be late before its intent counts
 * as rescheduled, and by which other tabs let the tab that paused an intent go
 * first.
 */
const wakeGap = 1000;

/**
 * How the client comes to send an intent: "user" (submit, retry: always, at
 * once), "trigger" (resume and wake-ups: unless someone attempted it since
 * `at`), "due" (the re-drive's timer for `at`: unless it was rescheduled).
 *
 * @typedef {{kind: "user"} | {kind: "trigger", at: number} | {kind: "due", at: number}} Drive
 */

/**
 * What one attempt got.
 *
 * @typedef {{kind: "error", cause: FailureCause, error: string}
 *   | {kind: "redirect", status: number, location: string}
 *   | {kind: "response", status: number, body: string, code: string, replayed: boolean, retryAfterMs: number, retryAfter: boolean, date: string | null}} Outcome
 */

/**
 * A Client sends intents to an idem service so that each takes effect once. It
 * mints the key when the user acts, journals the intent in IndexedDB before the
 * first send, and sends it again with that key until a final answer arrives:
 * in this page, which keeps at it while it is open, or, after a reload, a crash
 * or a restore, in the next one.
 */
export class Client {
  /** @type {Required<Omit<ClientOptions, "onEvent" | "fetch" | "headers" | "shouldRetry">>} */
  #cfg;
  /** @type {Journal} */
  #journal;
  /** @type {typeof fetch} */
  #fetch;
  /** @type {(e: IntentEvent) => void} */
  #onEvent;
  /** @type {ClientOptions["headers"]} */
  #headers;
  /** @type {ClientOptions["shouldRetry"]} */
  #shouldRetry;
  /** @type {Pacer} */
  #pacer;
  /** @type {BroadcastChannel | null} */
  #feed = null;
  /** @type {[EventTarget, string, () => void][]} */
  #listeners = [];
  /** The re-drive's timer per paused intent of this owner. */
  /** @type {Map<string, ReturnType<typeof setTimeout>>} */
  #plans = new Map();
  /** When this client minted each of its keys, on the page's monotonic clock. */
  /** @type {Map<string, number>} */
  #minted = new Map();
  /** Keys whose finished event this client emitted: once per intent. */
  /** @type {Set<string>} */
  #finished = new Set();
  /** The server's clock ahead of this device's, once a response said so. */
  #offset = 0;
  #closed = false;
  /** @type {Promise<boolean> | null} */
  #persisting = null;
  /** @type {Map<string, {at: number, reachable: Promise<boolean>}>} */
  #diagnoses = new Map();

  /** @param {ClientOptions} [options] */
  constructor(options = {}) {
    const scope = options.scope ?? "";
    const cfg = {
      journal: options.journal ?? defaults.journal,
      owner: options.owner ?? scope,
      baseURL: options.baseURL ?? globalThis.location?.origin ?? "",
      scope,
      maxAttempts: options.maxAttempts ?? defaults.maxAttempts,
      backoffBase: options.backoffBase ?? defaults.backoffBase,
      backoffMax: options.backoffMax ?? defaults.backoffMax,
      redrive: options.redrive ?? true,
      redriveMax: options.redriveMax ?? defaults.redriveMax,
      concurrency: options.concurrency ?? defaults.concurrency,
      timeout: options.timeout ?? defaults.timeout,
      keyLifetime: options.keyLifetime ?? defaults.keyLifetime,
      pruneAfter: options.pruneAfter ?? defaults.pruneAfter,
      keepResponses: options.keepResponses ?? false,
      credentials: options.credentials ?? "same-origin",
    };
    for (const name of /** @type {const} */ (["maxAttempts", "backoffBase", "backoffMax", "redriveMax", "concurrency", "timeout", "keyLifetime", "pruneAfter"])) {
      if (!(cfg[name] > 0)) {
        throw new RangeError(`idem: option ${name} must be a positive number, got ${cfg[name]}`);
      }
    }
    if (cfg.backoffMax < cfg.backoffBase) {
      throw new RangeError(`idem: option backoffMax ${cfg.backoffMax} is below backoffBase ${cfg.backoffBase}`);
    }
    if (cfg.redriveMax < cfg.backoffMax) {
      throw new RangeError(`idem: option redriveMax ${cfg.redriveMax} is below backoffMax ${cfg.backoffMax}`);
    }
    if (cfg.journal === "") {
      throw new RangeError("idem: option journal must name an IndexedDB database");
    }
    this.#cfg = cfg;
    this.#journal = new Journal(cfg.journal);
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.#onEvent = options.onEvent ?? (() => {});
    this.#headers = options.headers;
    this.#shouldRetry = options.shouldRetry;
    this.#pacer = new Pacer(Math.floor(cfg.concurrency));
    if (typeof BroadcastChannel === "function") {
      this.#feed = new BroadcastChannel(`idem:${cfg.journal}`);
      this.#feed.onmessage = (m) => this.#heard(m.data);
    }
    if (cfg.redrive && typeof globalThis.addEventListener === "function") {
      const wake = () => this.#wake();
      for (const type of ["online", "pageshow", "focus"]) {
        this.#listen(globalThis, type, wake);
      }
      const doc = globalThis.document;
      if (doc) {
        this.#listen(doc, "visibilitychange", () => {
          if (doc.visibilityState === "visible") {
            wake();
          }
        });
      }
    }
  }

  /**
   * Whether the tabs of this origin coordinate their sends (Web Locks, which
   * need a secure context). Without, two tabs may send one intent at once; the
   * server still folds them by the key.
   */
  get coordinated() {
    return Boolean(globalThis.navigator?.locks);
  }

  /** Whose intents this client sends, lists and forgets. */
  get owner() {
    return this.#cfg.owner;
  }

  /**
   * Submits a new intent: mints its key, journals it, and only then sends it,
   * retrying with the same key on a timeout, a network error, a 5xx, 408, 425,
   * 429 or a 409 that says the first arrival still runs (after a jittered
   * backoff, or the server's Retry-After) until a final answer: a 2xx is done,
   * any other 4xx is rejected. Call it once per user act: two calls are two
   * intents.
   *
   * It resolves with the Result once the answer is final, or once the round's
   * attempts are spent, the browser is offline or the answer was a redirect:
   * then the intent is pending (error and cause say why) and, while the page is
   * open, the client keeps sending it by itself (retryAt says when next). It
   * rejects with JournalUnavailableError when the intent could not be journaled
   * (then nothing was sent), and with IntentGoneError when the intent left the
   * journal before a final answer came (then it is not sent again).
   *
   * @param {SubmitRequest} req
   * @returns {Promise<Result>}
   */
  async submit(req) {
    const url = new URL(req.path, this.#cfg.baseURL || undefined).href;
    const headers = requestHeaders(req.headers);
    const now = Date.now();
    // The key carries the time it was minted; a server checks its age against
    // its own clock, so the key follows the server's clock once it is known.
    const key = newKey(now + this.#offset);
    /** @type {IntentRecord} */
    const rec = {
      key,
      owner: this.#cfg.owner,
      scope: this.#cfg.scope,
      method: (req.method ?? "POST").toUpperCase(),
      url,
      body: req.body === undefined ? "" : typeof req.body === "string" ? req.body : JSON.stringify(req.body),
      createdAt: now,
      attempts: 0,
      status: "pending",
    };
    if (req.contentType) {
      rec.contentType = req.contentType;
    }
    if (headers) {
      rec.headers = headers;
    }
    // The lock first, so that no other tab picks the new intent up between the
    // journal and the first send.
    return this.#exclusive(key, async () => {
      // The key is on disk before anything leaves the page: from here on, a
      // reload, a crash or a lost response all end in this key being sent again.
      await this.#journal.append(rec);
      this.#minted.set(key, performance.now());
      this.#emit({ type: "journaled", key }, rec);
      return this.#round(rec, this.#cfg.maxAttempts, { kind: "user" });
    });
  }

  /**
   * Sends every pending intent of this owner again, each with its own key: what
   * a page runs when it loads, or once the user has signed in, after a reload, a
   * crash or a restored session. An intent another tab is sending is waited for,
   * not sent twice. Expired intents are not sent. It first prunes (see prune).
   * Requests go out `concurrency` at a time.
   *
   * @returns {Promise<Result[]>} one Result per pending intent, oldest first
   */
  async resume() {
    await this.prune();
    return this.#sendPending(Date.now());
  }

  /**
   * Sends one pending intent of this owner now, with its key, whatever its
   * re-drive's schedule: a "Try again now" button. It resolves as submit does,
   * or with undefined when the journal holds no such intent of this owner; a
   * finished one is returned as it is.
   *
   * @param {string} key
   * @returns {Promise<Result | undefined>}
   */
  retry(key) {
    return this.#take(key, this.#cfg.maxAttempts, { kind: "user" });
  }

  /**
   * Every intent of this owner in the journal, oldest first, pending ones past
   * the key lifetime reported as expired. It sends nothing.
   *
   * @returns {Promise<Result[]>}
   */
  async list() {
    return (await this.#journal.all(this.#cfg.owner)).map((rec) => this.#result(rec));
  }

  /**
   * One intent of this owner, or undefined when the journal holds no such one.
   *
   * @param {string} key
   * @returns {Promise<Result | undefined>}
   */
  async status(key) {
    const rec = await this.#journal.get(key);
    return rec && rec.owner === this.#cfg.owner ? this.#result(rec) : undefined;
  }

  /**
   * Deletes one intent of this owner from the journal, pending or not, and stops
   * sending it. A pending intent forgotten may still have taken effect.
   *
   * @param {string} key
   * @returns {Promise<boolean>} whether the journal held it
   */
  async forget(key) {
    const had = await this.#journal.forget(key, this.#cfg.owner);
    if (had) {
      this.#unplan(key);
      this.#emit({ type: "forgotten", key });
    }
    return had;
  }

  /**
   * Deletes every intent of this owner from the journal and stops sending them:
   * call it when the user signs out, so that nothing of theirs is sent under the
   * next user's session, and their bodies do not stay on the device. Pending
   * intents (list() shows them) may still have taken effect, or may not: tell
   * the user before.
   *
   * @returns {Promise<number>} how many were deleted
   */
  async clear() {
    const keys = await this.#journal.clear(this.#cfg.owner);
    for (const key of keys) {
      this.#unplan(key);
      this.#emit({ type: "forgotten", key });
    }
    return keys.length;
  }

  /**
   * Deletes, whoever owns them, finished intents whose response arrived longer
   * ago than olderThan milliseconds, and expired ones past their key lifetime by
   * that much. Pending intents within their lifetime are kept: their key is
   * still the only name of their intent.
   *
   * @param {number} [olderThan] default pruneAfter
   * @returns {Promise<number>} how many were deleted
   */
  prune(olderThan = this.#cfg.pruneAfter) {
    const now = Date.now();
    return this.#journal.prune({ finishedBefore: now - olderThan, now, staleAfter: this.#cfg.keyLifetime + olderThan });
  }

  /**
   * Asks the browser to keep this origin's storage, the journal with it, under
   * storage pressure (navigator.storage.persist()); without, the journal is
   * best-effort: the browser may evict it. Some browsers ask the user, so call
   * it on a user's act. It resolves with whether storage is persistent (false
   * where the API is missing).
   *
   * @returns {Promise<boolean>}
   */
  persist() {
    this.#persisting ??= (async () => {
      const storage = globalThis.navigator?.storage;
      if (!storage?.persist || !storage.persisted) {
        return false;
      }
      try {
        return (await storage.persisted()) || (await storage.persist());
      } catch {
        return false;
      }
    })();
    return this.#persisting;
  }

  /** Stops sending, stops hearing other tabs, and closes the journal. */
  close() {
    this.#closed = true;
    for (const [target, type, fn] of this.#listeners) {
      target.removeEventListener(type, fn);
    }
    this.#listeners = [];
    for (const key of [...this.#plans.keys()]) {
      this.#unplan(key);
    }
    this.#feed?.close();
    this.#feed = null;
    this.#journal.close();
  }

  /**
   * @param {EventTarget} target
   * @param {string} type
   * @param {() => void} fn
   */
  #listen(target, type, fn) {
    target.addEventListener(type, fn);
    this.#listeners.push([target, type, fn]);
  }

  /**
   * The browser is back online, or the page is shown again: send what waits.
   * Wake-ups that come together (focus, visibilitychange and pageshow do) send
   * an intent once: each skips an intent attempted since it came.
   */
  #wake() {
    if (!this.#closed) {
      this.#sendPending(Date.now()).catch(() => {});
    }
  }

  /**
   * @param {number} at
   * @returns {Promise<Result[]>}
   */
  async #sendPending(at) {
    const pending = await this.#journal.pending(this.#cfg.owner);
    const results = await Promise.all(pending.map((rec) => this.#take(rec.key, this.#cfg.maxAttempts, { kind: "trigger", at })));
    return /** @type {Result[]} */ (results.filter((r) => r !== undefined));
  }

  /**
   * Takes a journaled intent up under its lock and runs a round of it, unless
   * the drive says another client already did.
   *
   * @param {string} key
   * @param {number} budget attempts of the round
   * @param {Drive} drive
   * @returns {Promise<Result | undefined>}
   */
  async #take(key, budget, drive) {
    this.#unplan(key);
    return this.#exclusive(key, async (waited) => {
      // Read again under the lock: the tab that held it may have finished it.
      const cur = await this.#journal.get(key);
      if (!cur || cur.owner !== this.#cfg.owner) {
        if (waited || drive.kind !== "user") {
          this.#emit({ type: "gone", key });
        }
        return undefined;
      }
      if (cur.status !== "pending") {
        if (waited) {
          this.#emitFinished(cur, true);
        }
        return this.#result(cur);
      }
      const rescheduled = drive.kind === "due" && (cur.retryAt ?? 0) > drive.at + wakeGap;
      const attemptedSince = drive.kind === "trigger" && (cur.lastAttemptAt ?? 0) >= drive.at;
      if (this.#closed || rescheduled || attemptedSince) {
        this.#plan(cur);
        return this.#result(cur);
      }
      try {
        return await this.#round(cur, budget, drive);
      } catch (e) {
        if (e instanceof IntentGoneError && drive.kind !== "user") {
          return undefined;
        }
        throw e;
      }
    });
  }

  /**
   * Runs fn holding the intent's lock, so that one tab at a time sends it. Web
   * Locks are released when their tab closes, reloads or crashes, so a waiting
   * tab takes over then. Without Web Locks (an insecure context), tabs do not
   * coordinate; the server still folds their sends, by the key.
   *
   * @template T
   * @param {string} key
   * @param {(waited: boolean) => Promise<T>} fn
   * @returns {Promise<T>}
   */
  async #exclusive(key, fn) {
    const locks = globalThis.navigator?.locks;
    if (!locks) {
      return fn(false);
    }
    const name = `idem:${this.#cfg.journal}:${key}`;
    /** @type {{ran: false} | {ran: true, value: T}} */
    const first = await locks.request(name, { ifAvailable: true }, async (lock) => {
      if (!lock) {
        return { ran: false };
      }
      return { ran: true, value: await fn(false) };
    });
    if (first.ran) {
      return first.value;
    }
    this.#emit({ type: "waiting", key });
    return locks.request(name, () => fn(true));
  }

  /**
   * One round of attempts of a journaled intent, run under its lock: up to
   * budget attempts, then a pause.
   *
   * @param {IntentRecord} rec
   * @param {number} budget
   * @param {Drive} drive
   * @returns {Promise<Result>}
   */
  async #round(rec, budget, drive) {
    const cfg = this.#cfg;
    /** @type {Outcome | null} */
    let last = null;
    for (let n = 1; ; n++) {
      const why = expiry(rec.createdAt, Date.now(), cfg.keyLifetime);
      if (why) {
        this.#emit({ type: "expired", key: rec.key, error: why });
        return { ...this.#result(rec), status: "expired", error: why };
      }
      if (globalThis.navigator?.onLine === false) {
        // No attempt is spent while there is no network: the "online" event
        // sends the intent.
        const error = "offline: the intent is journaled and is sent with its key when the browser is back online";
        await this.#journal.schedule(rec.key, { retryAt: 0, pauses: rec.pauses ?? 0, cause: "offline", lastError: error });
        this.#emit({ type: "offline", key: rec.key, error, cause: "offline" });
        return { ...this.#result(rec), error, cause: "offline", retryAt: 0 };
      }
      // Counted before the send, so a crash mid-send still shows it. A finished
      // record means another tab got the answer: it is not sent again.
      try {
        rec = await this.#journal.recordAttempt(rec.key, Date.now());
      } catch (e) {
        throw withLastAnswer(e, last);
      }
      if (rec.status !== "pending") {
        this.#emitFinished(rec, true);
        return this.#result(rec);
      }
      this.#emit({ type: "sending", key: rec.key, attempt: rec.attempts });
      const out = await this.#attempt(rec, drive.kind !== "user");
      last = out;
      if (out.kind === "response") {
        const info = { status: out.status, code: out.code, retryAfter: out.retryAfter };
        const again = this.#shouldRetry?.(info) ?? retryable(info);
        if (!again) {
          const renamed = await this.#rekeyed(rec, out, budget - n, drive);
          return renamed ?? this.#finish(rec, out);
        }
      }
      const failure = describe(out);
      const step = out.kind === "redirect"
        ? { step: "pause", delay: 0 }
        : nextStep(n, budget, { base: cfg.backoffBase, max: cfg.backoffMax }, out.kind === "response" ? out.retryAfterMs : 0);
      if (step.step === "retry") {
        this.#emit({ type: "failed", key: rec.key, attempt: rec.attempts, ...failure, delay: step.delay, retryAt: Date.now() + step.delay });
        await sleep(step.delay);
        continue;
      }
      // The last attempt of the round: no delay, and what follows is said next.
      this.#emit({ type: "failed", key: rec.key, attempt: rec.attempts, ...failure });
      try {
        return await this.#pause(rec, failure, step.delay);
      } catch (e) {
        throw withLastAnswer(e, last);
      }
    }
  }

  /**
   * Ends a round with the intent pending, and plans its next attempt.
   *
   * @param {IntentRecord} rec
   * @param {{cause: FailureCause, error: string}} failure
   * @param {number} atLeast the server's wait, milliseconds; 0 for none
   * @returns {Promise<Result>}
   */
  async #pause(rec, failure, atLeast) {
    const cfg = this.#cfg;
    const pauses = rec.pauses ?? 0;
    const delay = Math.max(atLeast, redriveDelay(pauses, { first: cfg.backoffMax, max: cfg.redriveMax }));
    const redrive = cfg.redrive && !this.#closed;
    const retryAt = redrive ? Date.now() + delay : 0;
    rec = await this.#journal.schedule(rec.key, { retryAt, pauses: pauses + 1, cause: failure.cause, lastError: failure.error });
    if (rec.status !== "pending") {
      this.#emitFinished(rec, true);
      return this.#result(rec);
    }
    if (redrive) {
      this.#plan(rec);
      this.#emit({ type: "paused", key: rec.key, ...failure, delay, retryAt }, rec);
    } else {
      this.#emit({ type: "exhausted", key: rec.key, ...failure });
    }
    return this.#result(rec);
  }

  /**
   * Records a final answer. When the intent left the journal meanwhile (a
   * logout, site data cleared), the answer is still the intent's outcome: it
   * is returned, though the journal no longer keeps it.
   *
   * @param {IntentRecord} rec
   * @param {Extract<Outcome, {kind: "response"}>} out
   * @returns {Promise<Result>}
   */
  async #finish(rec, out) {
    /** @type {"done" | "rejected"} */
    const status = out.status >= 200 && out.status <= 299 ? "done" : "rejected";
    const lastError = status === "done" ? "" : rejectionMessage(out.status, out.code, errorMessage(out.body));
    const fin = { status, httpStatus: out.status, code: out.code, response: out.body, replayed: out.replayed, lastError };
    let gone = "";
    /** @type {{rec: IntentRecord, first: boolean}} */
    let got;
    try {
      got = await this.#journal.finish(rec.key, fin, this.#cfg.keepResponses);
    } catch (e) {
      if (!(e instanceof IntentGoneError)) {
        throw e;
      }
      gone = "the intent left the journal while it was sent (forgotten, or site data cleared); " +
        "this final answer is its outcome, but the journal does not keep it";
      got = { rec: { ...rec, ...fin, finishedAt: Date.now() }, first: true };
    }
    if (!got.first) {
      // Another tab's answer came first: that one is the intent's.
      this.#emitFinished(got.rec, true);
      return this.#result(got.rec);
    }
    this.#emitFinished(got.rec, false, gone);
    return { ...this.#result(got.rec), response: parseBody(out.body), error: gone || lastError };
  }

  /**
   * Sends the intent again under a new key when the server refused its key for
   * its age, and this client can tell that the refusal is this device's clock:
   * it minted the key itself less than a key lifetime ago by the page's
   * monotonic clock, and the response's Date says how far off the clock is. The
   * server keeps a key's record at least a key lifetime, and answered that it
   * holds none: the first key never took effect, so the new one is the same
   * intent, sent once. Otherwise it returns null and the refusal is final.
   *
   * @param {IntentRecord} rec
   * @param {Extract<Outcome, {kind: "response"}>} out
   * @param {number} budget attempts left in the round
   * @param {Drive} drive
   * @returns {Promise<Result | null>}
   */
  async #rekeyed(rec, out, budget, drive) {
    const mintedAt = this.#minted.get(rec.key);
    const offset = clockOffset(out.date, Date.now());
    if (out.status !== 422 || !isKeyAgeCode(out.code) || rec.previousKey || mintedAt === undefined ||
      performance.now() - mintedAt >= this.#cfg.keyLifetime || offset === null || Math.abs(offset) <= clockSkewAllowanceMs) {
      return null;
    }
    this.#offset = offset;
    const key = newKey(Date.now() + offset);
    const hours = Math.round(Math.abs(offset) / 36e5);
    const error = `this device's clock is about ${hours} h ${offset > 0 ? "behind" : "ahead of"} the server's, which refused key ${rec.key} ` +
      `for its age (${out.code}) and did not run it; the same intent is sent again under ${key}, minted by the server's clock`;
    /** @type {IntentRecord} */
    const next = { ...rec, key, previousKey: rec.key, cause: "clock", lastError: error };
    return this.#exclusive(key, async () => {
      await this.#journal.rekey(rec.key, next);
      this.#minted.set(key, mintedAt);
      this.#emit({ type: "rekeyed", key, previousKey: rec.key, error, cause: "clock" });
      return this.#round(next, Math.max(budget, 1), drive);
    });
  }

  /**
   * Sends one attempt and reads the whole answer within the timeout, which
   * starts when the request is handed to fetch. A response whose body cannot be
   * read counts as lost: the server replays it next time.
   *
   * @param {IntentRecord} rec
   * @param {boolean} paced wait for one of the concurrency slots first
   * @returns {Promise<Outcome>}
   */
  async #attempt(rec, paced) {
    const release = paced ? await this.#pacer.acquire() : () => {};
    const ctl = new AbortController();
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    let timer;
    try {
      /** @type {Record<string, string>} */
      const headers = { ...(await this.#headers?.()), ...rec.headers, "Idempotency-Key": rec.key, Accept: "application/json" };
      if (rec.body) {
        headers["Content-Type"] = rec.contentType ?? "application/json";
      }
      if (rec.scope !== "") {
        headers["Idempotency-Scope"] = rec.scope;
      }
      timer = setTimeout(() => ctl.abort(new Error(`timed out after ${this.#cfg.timeout} ms`)), this.#cfg.timeout);
      const res = await this.#fetch(rec.url, {
        method: rec.method,
        headers,
        body: rec.body ? rec.body : undefined,
        // A redirect would journal the answer to another request as this one's.
        redirect: "manual",
        cache: "no-store",
        credentials: this.#cfg.credentials,
        signal: ctl.signal,
      });
      if (res.type === "opaqueredirect" || (res.status >= 300 && res.status <= 399)) {
        return { kind: "redirect", status: res.status, location: res.headers.get("Location") ?? "" };
      }
      const body = await res.text();
      const date = res.headers.get("Date");
      const offset = clockOffset(date, Date.now());
      if (offset !== null) {
        // Keys follow the server's clock while this one is off, and this one's again once it is right.
        this.#offset = Math.abs(offset) > clockSkewAllowanceMs ? offset : 0;
      }
      return {
        kind: "response",
        status: res.status,
        body,
        code: errorCode(body, res.headers.get("Content-Type") ?? ""),
        replayed: (res.headers.get("Idempotent-Replayed") ?? "").toLowerCase() === "true",
        retryAfterMs: parseRetryAfter(res.headers.get("Retry-After"), Date.now()),
        retryAfter: res.headers.has("Retry-After"),
        date,
      };
    } catch (e) {
      if (ctl.signal.aborted && ctl.signal.reason instanceof Error) {
        return { kind: "error", cause: "timeout", error: ctl.signal.reason.message };
      }
      const error = e instanceof Error ? e.message : String(e);
      if (e instanceof TypeError) {
        return this.#diagnose(rec.url, error);
      }
      return { kind: "error", cause: "network", error };
    } finally {
      clearTimeout(timer);
      release();
    }
  }

  /**
   * Tells a CORS failure from an outage. The browser reports both as the same
   * TypeError, but a no-cors request, whose answer the page may not read, still
   * reaches a service that is up: so when it gets through, the service answered
   * and the browser hid that answer from the page.
   *
   * @param {string} url
   * @param {string} error
   * @returns {Promise<Outcome>}
   */
  async #diagnose(url, error) {
    const pageOrigin = globalThis.location?.origin;
    const apiOrigin = new URL(url).origin;
    if (!pageOrigin || pageOrigin === apiOrigin) {
      return { kind: "error", cause: "network", error: `the service is unreachable (${error})` };
    }
    let d = this.#diagnoses.get(apiOrigin);
    if (!d || Date.now() - d.at > diagnosisTTL) {
      d = { at: Date.now(), reachable: this.#reachable(url) };
      this.#diagnoses.set(apiOrigin, d);
    }
    if (!(await d.reachable)) {
      return { kind: "error", cause: "network", error: `${apiOrigin} is unreachable (${error})` };
    }
    return {
      kind: "error",
      cause: "cors",
      error: `${apiOrigin} is reachable, but the browser hid its answer from this page (${error}): ` +
        `its CORS configuration does not let ${pageOrigin} read it. ${corsContract(pageOrigin, apiOrigin)}. ` +
        "The request may have taken effect: it stays pending and is sent again with the same key, which the server folds",
    };
  }

  /**
   * @param {string} url
   * @returns {Promise<boolean>}
   */
  async #reachable(url) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), Math.min(this.#cfg.timeout, 5000));
    try {
      // GET has no effect to fold; no-cors sends no preflight and no custom header.
      await this.#fetch(url, { method: "GET", mode: "no-cors", credentials: "omit", cache: "no-store", signal: ctl.signal });
      return true;
    } catch {
      return false;
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * Plans the re-drive's next attempt of a paused intent of this owner, at its
   * retryAt, or at its horizon when that comes first (then it is reported
   * expired).
   *
   * @param {IntentRecord} rec
   * @param {number} [late] milliseconds after retryAt: other tabs let the tab
   *   that paused the intent go first
   */
  #plan(rec, late = 0) {
    this.#unplan(rec.key);
    const retryAt = rec.retryAt ?? 0;
    if (!this.#cfg.redrive || this.#closed || rec.status !== "pending" || retryAt === 0) {
      return;
    }
    const at = Math.min(retryAt + late, rec.createdAt + this.#cfg.keyLifetime);
    const timer = setTimeout(() => {
      this.#plans.delete(rec.key);
      this.#take(rec.key, 1, { kind: "due", at: retryAt }).catch(() => {});
    }, Math.max(0, at - Date.now()));
    this.#plans.set(rec.key, timer);
  }

  /** @param {string} key */
  #unplan(key) {
    clearTimeout(this.#plans.get(key));
    this.#plans.delete(key);
  }

  /**
   * What another tab's client of this journal did: shown as this client's own
   * event, marked otherTab, and followed by this client's plans.
   *
   * @param {unknown} msg
   */
  #heard(msg) {
    if (this.#closed || !msg || typeof msg !== "object") {
      return;
    }
    const { owner, event, retryAt, createdAt } = /** @type {{owner: unknown, event: IntentEvent, retryAt: unknown, createdAt: unknown}} */ (msg);
    if (owner !== this.#cfg.owner || !event || typeof event.key !== "string") {
      return;
    }
    const key = event.key;
    switch (event.type) {
      case "paused":
      case "journaled":
        if (typeof createdAt === "number") {
          // A new intent's tab may die before it pauses: take over after a round's worth.
          const at = typeof retryAt === "number" && retryAt > 0 ? retryAt : Date.now() + this.#cfg.backoffMax * 2;
          /** @type {IntentRecord} */
          const rec = { key, owner: this.#cfg.owner, scope: "", method: "", url: "", createdAt, attempts: 0, status: "pending", retryAt: at };
          this.#plan(rec, wakeGap);
        }
        break;
      case "finished":
        if (this.#finished.has(key)) {
          return;
        }
        this.#finished.add(key);
        this.#unplan(key);
        break;
      case "expired":
      case "gone":
      case "forgotten":
        this.#unplan(key);
        break;
      case "rekeyed":
        if (event.previousKey) {
          this.#unplan(event.previousKey);
        }
        break;
    }
    this.#deliver({ ...event, otherTab: true });
  }

  /**
   * @param {IntentRecord} rec
   * @param {boolean} otherTab the answer was recorded by another tab
   * @param {string} [error]
   */
  #emitFinished(rec, otherTab, error = "") {
    if (this.#finished.has(rec.key)) {
      return;
    }
    this.#finished.add(rec.key);
    this.#unplan(rec.key);
    /** @type {IntentEvent} */
    const e = { type: "finished", key: rec.key, attempt: rec.attempts, httpStatus: rec.httpStatus, code: rec.code ?? "" };
    if (error) {
      e.error = error;
    }
    if (otherTab) {
      // Heard by this tab, not done by it: the other tabs heard it from the tab that did.
      this.#deliver({ ...e, otherTab: true });
      return;
    }
    this.#emit(e);
  }

  /**
   * @param {IntentRecord} rec
   * @returns {Result}
   */
  #result(rec) {
    /** @type {Result} */
    const r = {
      key: rec.key,
      attempts: rec.attempts,
      status: rec.status,
      httpStatus: rec.httpStatus ?? 0,
      code: rec.code ?? "",
      response: rec.response === undefined ? undefined : parseBody(rec.response),
      replayed: rec.replayed ?? false,
      error: rec.lastError ?? "",
      cause: rec.status === "pending" ? rec.cause ?? "" : "",
      retryAt: rec.status === "pending" ? rec.retryAt ?? 0 : 0,
      previousKey: rec.previousKey ?? "",
      method: rec.method,
      url: rec.url,
      createdAt: rec.createdAt,
    };
    if (rec.status === "pending") {
      const why = expiry(rec.createdAt, Date.now(), this.#cfg.keyLifetime);
      if (why) {
        Object.assign(r, { status: "expired", error: why, retryAt: 0 });
      }
    }
    return r;
  }

  /**
   * Tells the page, and the other tabs' clients of this journal (all but that
   * this client waits, which is no news to them).
   *
   * @param {IntentEvent} e
   * @param {IntentRecord} [rec] the intent, for other tabs to plan its re-drive
   */
  #emit(e, rec) {
    this.#deliver(e);
    if (!this.#feed || e.type === "waiting") {
      return;
    }
    /** @type {Record<string, unknown>} */
    const msg = { owner: this.#cfg.owner, event: e };
    if (rec) {
      msg.createdAt = rec.createdAt;
      msg.retryAt = e.retryAt ?? 0;
    }
    try {
      this.#feed.postMessage(msg);
    } catch {
      // A closed channel: the other tabs read the journal on their next call.
    }
  }

  /** @param {IntentEvent} e */
  #deliver(e) {
    try {
      this.#onEvent(e);
    } catch {
      // A page's listener must not break the send loop.
    }
  }
}

/**
 * A request's own headers, checked: the client sets its idempotency headers,
 * the Content-Type and Accept itself.
 *
 * @param {Record<string, string> | undefined} headers
 * @returns {Record<string, string> | undefined}
 */
function requestHeaders(headers) {
  if (!headers) {
    return undefined;
  }
  /** @type {Record<string, string>} */
  const out = {};
  for (const [name, value] of Object.entries(headers)) {
    if (ownHeaders.includes(name.toLowerCase())) {
      throw new RangeError(`idem: header ${name} is the client's own: set contentType for the Content-Type, and leave the idempotency headers to the client`);
    }
    if (typeof value !== "string") {
      throw new TypeError(`idem: header ${name} must be a string, got ${typeof value}`);
    }
    out[name] = value;
  }
  return Object.keys(out).length > 0 ? out : undefined;
}

/**
 * Why an attempt got no final answer, for an event and the journal.
 *
 * @param {Outcome} out
 * @returns {{cause: FailureCause, error: string, httpStatus?: number}}
 */
function describe(out) {
  switch (out.kind) {
    case "error":
      return { cause: out.cause, error: out.error };
    case "redirect":
      return {
        cause: "redirect",
        httpStatus: out.status,
        error: `HTTP ${out.status || "3xx"} redirect ${out.location ? `to ${out.location}` : "without a Location"}, not followed: ` +
          "a redirect is not the service's answer; the intent stays pending until the service URL is fixed",
      };
    case "response":
      return { cause: "http", httpStatus: out.status, error: `HTTP ${out.status}${out.code ? ` ${out.code}` : ""}: ${snippet(out.body)}` };
  }
}

/**
 * An IntentGoneError carries the last answer the intent got, if any.
 *
 * @param {unknown} e
 * @param {Outcome | null} last
 * @returns {unknown}
 */
function withLastAnswer(e, last) {
  if (e instanceof IntentGoneError && last?.kind === "response") {
    e.httpStatus = last.status;
    e.response = parseBody(last.body);
  }
  return e;
}

/**
 * @param {number} ms
 * @returns {Promise<void>}
 */
function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * @param {string} body
 * @returns {unknown}
 */
function parseBody(body) {
  try {
    return JSON.parse(body);
  } catch {
    return body;
  }
}

/**
 * @param {string} body
 * @returns {string}
 */
function snippet(body) {
  const s = body.trim();
  return JSON.stringify(s.length > 200 ? `${s.slice(0, 200)}...` : s);
}
