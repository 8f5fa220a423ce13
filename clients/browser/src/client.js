// The client sends intents so that each takes effect once: mint the key on the
// user's act, journal it, then send; every retry, reload and restored tab sends
// that same key again.

import { IntentGoneError, Journal } from "./journal.js";
import { newKey } from "./key.js";
import { backoffDelay, expiry, parseRetryAfter, retryable } from "./retry.js";

/** @typedef {import("./journal.js").IntentRecord} IntentRecord */

/**
 * Where an intent stands, as in package client and `enqueue`'s output: "done" (a
 * 2xx was recorded), "pending" (no final response yet; resume() sends it again
 * with its key), "rejected" (a final 4xx was recorded) or "expired" (pending, but
 * past the key lifetime or of unknown age: never sent again, reconcile it by
 * hand).
 *
 * @typedef {"pending" | "done" | "rejected" | "expired"} IntentStatus
 */

/**
 * The outcome of one intent.
 *
 * @typedef {object} Result
 * @property {string} key names the intent
 * @property {number} attempts sends with the key, across tabs and reloads
 * @property {IntentStatus} status
 * @property {number} httpStatus the final response's status; 0 while pending
 * @property {unknown} response the final response's body, parsed when it is JSON;
 *   undefined while pending
 * @property {boolean} replayed the server answered from its record of the first
 *   arrival (Idempotent-Replayed: true) rather than executing again
 * @property {string} error why the intent needs attention that status does not
 *   spell out (expired, left pending after its attempts or while offline, a
 *   redirect, a 422); "" when none
 * @property {string} method
 * @property {string} url
 * @property {number} createdAt when the intent was journaled, milliseconds since the epoch
 */

/**
 * What happens to an intent, as it happens, for a page to show.
 *
 * - journaled: the intent is on disk; nothing was sent yet.
 * - waiting: another tab (or call) is sending this intent; this one waits for it.
 * - sending: attempt number `attempt` goes out.
 * - failed: the attempt got no final answer (`error`, `httpStatus` when there
 *   was a response); the next one follows after `delay` milliseconds.
 * - offline: the browser is offline; the intent stays pending and is sent when it
 *   is back online.
 * - finished: a final response was recorded (`httpStatus`).
 * - expired: the intent is past the key lifetime and is not sent again.
 * - gone: the intent is no longer in the journal and is not sent again.
 *
 * @typedef {object} IntentEvent
 * @property {"journaled" | "waiting" | "sending" | "failed" | "offline" | "finished" | "expired" | "gone"} type
 * @property {string} key
 * @property {number} [attempt]
 * @property {number} [httpStatus]
 * @property {number} [delay]
 * @property {string} [error]
 */

/**
 * @typedef {object} ClientOptions
 * @property {string} [journal] IndexedDB database of the intents (default "idem").
 *   Clients of one origin that name the same journal share its intents, and
 *   coordinate so that each intent is sent by one of them at a time.
 * @property {string} [baseURL] what request paths are resolved against (default:
 *   the page's origin). Another origin must allow the Idempotency-Key header
 *   (CORS) and expose Idempotent-Replayed.
 * @property {string} [scope] sent as Idempotency-Scope on new intents when not empty
 * @property {number} [maxAttempts] sends per submit() or resume() of one intent
 *   (default 8); the intent stays pending when they run out
 * @property {number} [backoffBase] milliseconds (default 100); see backoffMax
 * @property {number} [backoffMax] milliseconds (default 10000). Retry n waits a
 *   random time up to min(backoffMax, backoffBase·2^(n-1)), or at least a
 *   server's Retry-After, up to backoffMax.
 * @property {number} [timeout] milliseconds one attempt may take, response body
 *   included (default 10000)
 * @property {number} [keyLifetime] milliseconds a pending intent is sent again,
 *   counted from its creation (default 24 h, as package client's
 *   DefaultKeyLifetime). It must be shorter than the server's key lifetimes.
 * @property {number} [pruneAfter] milliseconds a finished intent is kept after its
 *   response (default 7 days); resume() prunes older ones
 * @property {typeof fetch} [fetch] sends the requests (default: the global fetch)
 * @property {(e: IntentEvent) => void} [onEvent] told what happens to each intent
 * @property {boolean} [resumeWhenOnline] resume() whenever the browser comes back
 *   online (default true)
 */

/** The defaults of ClientOptions, in milliseconds where a duration. */
export const defaults = Object.freeze({
  journal: "idem",
  maxAttempts: 8,
  backoffBase: 100,
  backoffMax: 10_000,
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
 *   with a different body (422).
 */

/**
 * A Client sends intents to an idem service so that each takes effect once. It
 * mints the key when the user acts, journals the intent in IndexedDB before the
 * first send, and sends it again with that key until a final answer arrives, in
 * this tab or, after a reload, a crash or a restore, in the next one.
 */
export class Client {
  /** @type {Required<Omit<ClientOptions, "onEvent" | "scope" | "fetch">> & {scope: string}} */
  #cfg;
  /** @type {Journal} */
  #journal;
  /** @type {typeof fetch} */
  #fetch;
  /** @type {(e: IntentEvent) => void} */
  #onEvent;
  /** @type {(() => void) | null} */
  #online = null;

  /** @param {ClientOptions} [options] */
  constructor(options = {}) {
    const cfg = {
      journal: options.journal ?? defaults.journal,
      baseURL: options.baseURL ?? globalThis.location?.origin ?? "",
      scope: options.scope ?? "",
      maxAttempts: options.maxAttempts ?? defaults.maxAttempts,
      backoffBase: options.backoffBase ?? defaults.backoffBase,
      backoffMax: options.backoffMax ?? defaults.backoffMax,
      timeout: options.timeout ?? defaults.timeout,
      keyLifetime: options.keyLifetime ?? defaults.keyLifetime,
      pruneAfter: options.pruneAfter ?? defaults.pruneAfter,
      resumeWhenOnline: options.resumeWhenOnline ?? true,
    };
    for (const name of /** @type {const} */ (["maxAttempts", "backoffBase", "backoffMax", "timeout", "keyLifetime", "pruneAfter"])) {
      if (!(cfg[name] > 0)) {
        throw new RangeError(`idem: option ${name} must be a positive number, got ${cfg[name]}`);
      }
    }
    if (cfg.backoffMax < cfg.backoffBase) {
      throw new RangeError(`idem: option backoffMax ${cfg.backoffMax} is below backoffBase ${cfg.backoffBase}`);
    }
    if (cfg.journal === "") {
      throw new RangeError("idem: option journal must name an IndexedDB database");
    }
    this.#cfg = cfg;
    this.#journal = new Journal(cfg.journal);
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.#onEvent = options.onEvent ?? (() => {});
    if (cfg.resumeWhenOnline && typeof globalThis.addEventListener === "function") {
      this.#online = () => {
        this.resume().catch(() => {});
      };
      globalThis.addEventListener("online", this.#online);
    }
  }

  /**
   * Submits a new intent: mints its key, journals it, and only then sends it,
   * retrying with the same key on a timeout, a network error, a 5xx, 408, 409,
   * 425 or 429 (after a jittered backoff, or the server's Retry-After) until a
   * final answer: a 2xx is done, any other 4xx (a 422 key mismatch included) is
   * rejected. Call it once per user act: two calls are two intents.
   *
   * It resolves with the Result, pending when the attempts ran out, the browser
   * is offline or the answer was a redirect (error says which); resume() sends a
   * pending intent again with its key. It rejects when the intent could not be
   * journaled (then it was never sent) and with IntentGoneError when the intent
   * left the journal while it was being sent (then it is not sent again).
   *
   * @param {SubmitRequest} req
   * @returns {Promise<Result>}
   */
  async submit(req) {
    const url = new URL(req.path, this.#cfg.baseURL || undefined).href;
    /** @type {IntentRecord} */
    const rec = {
      key: newKey(),
      scope: this.#cfg.scope,
      method: (req.method ?? "POST").toUpperCase(),
      url,
      body: req.body === undefined ? "" : typeof req.body === "string" ? req.body : JSON.stringify(req.body),
      createdAt: Date.now(),
      attempts: 0,
      status: "pending",
    };
    // The lock first, so that no other tab's resume() picks the new intent up
    // between the journal and the first send.
    return this.#exclusive(rec.key, async () => {
      // The key is on disk before anything leaves the page: from here on, a
      // reload, a crash or a lost response all end in this key being sent again.
      await this.#journal.append(rec);
      this.#emit({ type: "journaled", key: rec.key });
      return this.#send(rec);
    });
  }

  /**
   * Sends every pending intent of the journal again, each with its own key: what
   * a page runs when it loads, after a reload, a crash or a restored session. An
   * intent another tab is sending is waited for, not sent twice. Expired intents
   * are not sent. It first prunes finished intents older than pruneAfter.
   *
   * @returns {Promise<Result[]>} one Result per pending intent, oldest first
   */
  async resume() {
    await this.prune();
    const pending = await this.#journal.pending();
    const results = await Promise.all(pending.map((rec) => this.#exclusive(rec.key, async () => {
      // Read again under the lock: the tab that held it may have finished it.
      const cur = await this.#journal.get(rec.key);
      if (!cur) {
        this.#emit({ type: "gone", key: rec.key });
        return null;
      }
      if (cur.status !== "pending") {
        return this.#result(cur);
      }
      try {
        return await this.#send(cur);
      } catch (e) {
        if (e instanceof IntentGoneError) {
          return null;
        }
        throw e;
      }
    })));
    return /** @type {Result[]} */ (results.filter((r) => r !== null));
  }

  /**
   * Every intent in the journal, oldest first, pending ones past the key
   * lifetime reported as expired. It sends nothing.
   *
   * @returns {Promise<Result[]>}
   */
  async list() {
    return (await this.#journal.all()).map((rec) => this.#result(rec));
  }

  /**
   * One intent, or undefined when the journal does not hold its key.
   *
   * @param {string} key
   * @returns {Promise<Result | undefined>}
   */
  async status(key) {
    const rec = await this.#journal.get(key);
    return rec && this.#result(rec);
  }

  /**
   * Deletes finished intents whose response arrived longer ago than olderThan
   * milliseconds. Pending and expired intents are kept: their key is still the
   * only name of their intent.
   *
   * @param {number} [olderThan] default pruneAfter
   * @returns {Promise<number>} how many were deleted
   */
  prune(olderThan = this.#cfg.pruneAfter) {
    return this.#journal.prune(Date.now() - olderThan);
  }

  /** Stops resuming when online and closes the journal. */
  close() {
    if (this.#online) {
      globalThis.removeEventListener("online", this.#online);
      this.#online = null;
    }
    this.#journal.close();
  }

  /**
   * Runs fn holding the intent's lock, so that one tab at a time sends it. Web
   * Locks are released when their tab closes, reloads or crashes, so a waiting
   * tab takes over then. Without Web Locks (an insecure context), tabs do not
   * coordinate; the server still folds their sends, by the key.
   *
   * @template T
   * @param {string} key
   * @param {() => Promise<T>} fn
   * @returns {Promise<T>}
   */
  async #exclusive(key, fn) {
    const locks = globalThis.navigator?.locks;
    if (!locks) {
      return fn();
    }
    const name = `idem:${this.#cfg.journal}:${key}`;
    /** @type {{ran: false} | {ran: true, value: T}} */
    const first = await locks.request(name, { ifAvailable: true }, async (lock) => {
      if (!lock) {
        return { ran: false };
      }
      return { ran: true, value: await fn() };
    });
    if (first.ran) {
      return first.value;
    }
    this.#emit({ type: "waiting", key });
    return locks.request(name, () => fn());
  }

  /**
   * The retry loop of one journaled intent, run under its lock.
   *
   * @param {IntentRecord} rec
   * @returns {Promise<Result>}
   */
  async #send(rec) {
    const cfg = this.#cfg;
    let lastError = "";
    let wait = 0;
    for (let n = 1; n <= cfg.maxAttempts; n++) {
      const why = expiry(rec.createdAt, Date.now(), cfg.keyLifetime);
      if (why) {
        this.#emit({ type: "expired", key: rec.key, error: why });
        return { ...this.#result(rec), status: "expired", error: why };
      }
      if (n > 1) {
        await sleep(wait);
      }
      if (globalThis.navigator?.onLine === false) {
        // No attempt is spent while there is no network: the "online" event
        // resumes the intent.
        const error = "offline: the intent is journaled and is sent with its key when the browser is back online";
        this.#emit({ type: "offline", key: rec.key, error });
        return { ...this.#result(rec), error };
      }
      // Counted before the send, so a crash mid-send still shows it. A finished
      // record means another tab got the answer: it is not sent again.
      rec = await this.#journal.recordAttempt(rec.key);
      if (rec.status !== "pending") {
        return this.#result(rec);
      }
      this.#emit({ type: "sending", key: rec.key, attempt: rec.attempts });
      /** @type {Answer} */
      let ans;
      try {
        ans = await this.#attempt(rec);
      } catch (e) {
        lastError = e instanceof Error ? e.message : String(e);
        wait = backoffDelay(n, { base: cfg.backoffBase, max: cfg.backoffMax });
        this.#emit({ type: "failed", key: rec.key, attempt: rec.attempts, error: lastError, delay: wait });
        continue;
      }
      if (ans.redirect) {
        // Not the service's answer, and the same URL redirects again: stop, pending.
        const error = `HTTP ${ans.status || "3xx"} redirect ${ans.location ? `to ${ans.location}` : "without a Location"}, not followed: ` +
          "a redirect is not the service's answer; the intent stays pending: fix the service URL, then resume() sends it with the same key";
        this.#emit({ type: "failed", key: rec.key, attempt: rec.attempts, httpStatus: ans.status, error });
        return { ...this.#result(rec), error };
      }
      if (retryable(ans.status)) {
        lastError = `HTTP ${ans.status}: ${snippet(ans.body)}`;
        wait = backoffDelay(n, { base: cfg.backoffBase, max: cfg.backoffMax }, parseRetryAfter(ans.retryAfter, Date.now()));
        this.#emit({ type: "failed", key: rec.key, attempt: rec.attempts, httpStatus: ans.status, error: lastError, delay: wait });
        continue;
      }
      const fin = await this.#journal.finish(rec.key, {
        status: ans.status >= 200 && ans.status <= 299 ? "done" : "rejected",
        httpStatus: ans.status,
        response: ans.body,
        replayed: ans.replayed,
      });
      this.#emit({ type: "finished", key: rec.key, attempt: rec.attempts, httpStatus: fin.httpStatus });
      return this.#result(fin);
    }
    const error = `still pending after ${rec.attempts} attempts (${lastError}); resume() sends it again with the same key`;
    return { ...this.#result(rec), error };
  }

  /**
   * Sends one attempt and reads the whole answer within the timeout. A response
   * whose body cannot be read counts as lost: the server replays it next time.
   *
   * @param {IntentRecord} rec
   * @returns {Promise<Answer>}
   */
  async #attempt(rec) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(new Error(`timed out after ${this.#cfg.timeout} ms`)), this.#cfg.timeout);
    try {
      /** @type {Record<string, string>} */
      const headers = { "Idempotency-Key": rec.key, Accept: "application/json" };
      if (rec.body !== "") {
        headers["Content-Type"] = "application/json";
      }
      if (rec.scope !== "") {
        headers["Idempotency-Scope"] = rec.scope;
      }
      const res = await this.#fetch(rec.url, {
        method: rec.method,
        headers,
        body: rec.body === "" ? undefined : rec.body,
        // A redirect would journal the answer to another request as this one's.
        redirect: "manual",
        cache: "no-store",
        signal: ctl.signal,
      });
      if (res.type === "opaqueredirect" || (res.status >= 300 && res.status <= 399)) {
        return { redirect: true, status: res.status, location: res.headers.get("Location") ?? "", body: "", replayed: false, retryAfter: null };
      }
      const body = await res.text();
      return {
        redirect: false,
        status: res.status,
        location: "",
        body,
        replayed: (res.headers.get("Idempotent-Replayed") ?? "").toLowerCase() === "true",
        retryAfter: res.headers.get("Retry-After"),
      };
    } catch (e) {
      if (ctl.signal.aborted && ctl.signal.reason instanceof Error) {
        throw ctl.signal.reason;
      }
      throw e;
    } finally {
      clearTimeout(timer);
    }
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
      response: rec.response === undefined ? undefined : parseBody(rec.response),
      replayed: rec.replayed ?? false,
      error: "",
      method: rec.method,
      url: rec.url,
      createdAt: rec.createdAt,
    };
    if (rec.status === "pending") {
      const why = expiry(rec.createdAt, Date.now(), this.#cfg.keyLifetime);
      if (why) {
        r.status = "expired";
        r.error = why;
      }
    } else if (rec.httpStatus === 422) {
      r.error = "HTTP 422: the server holds this key for a different request; a key is never reused for another body, so this intent stays rejected";
    }
    return r;
  }

  /** @param {IntentEvent} e */
  #emit(e) {
    try {
      this.#onEvent(e);
    } catch {
      // A page's listener must not break the send loop.
    }
  }
}

/**
 * What one attempt got back.
 *
 * @typedef {object} Answer
 * @property {boolean} redirect
 * @property {number} status
 * @property {string} location
 * @property {string} body
 * @property {boolean} replayed
 * @property {string | null} retryAfter
 */

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
