// When to send again, and how long to wait first. Pure functions of their
// arguments, so they are tested under Node without a browser.

/** The longest wait a Retry-After can ask for: one day, as package client. */
const maxRetryAfterMs = 24 * 60 * 60 * 1000;

/**
 * How far ahead of the clock a journaled createdAt may be and still count as age
 * zero: clock jitter, not a clock set back by hours.
 */
export const clockSkewAllowanceMs = 60 * 1000;

/** The server's code for "a request with this key is still running" (409). */
export const inProgressCode = "idempotency_key_in_use";

/**
 * What a server answered, as the retry decision sees it.
 *
 * @typedef {object} AnswerInfo
 * @property {number} status the HTTP status
 * @property {string} code the error code the body names ("" for none)
 * @property {boolean} retryAfter the answer carried a Retry-After header
 */

/**
 * Reports whether an answer leaves the outcome open, so the same request is sent
 * again with the same key. 5xx: the server failed, perhaps before committing.
 * 408, 425 and 429: the server asks the client to come back. 409 only when it
 * says the first arrival with this key is still running (the in-progress code,
 * or a Retry-After): any other 409 is an application's answer ("already
 * exists", a version conflict), final like every other 4xx.
 *
 * @param {AnswerInfo} a
 * @returns {boolean}
 */
export function retryable(a) {
  if (a.status === 409) {
    return a.code === inProgressCode || a.retryAfter;
  }
  return a.status >= 500 || a.status === 408 || a.status === 425 || a.status === 429;
}

/**
 * Reads a Retry-After header (RFC 9110): delay-seconds or an HTTP-date.
 * Anything else, a date in the past, and no header are 0: no hint.
 *
 * @param {string | null | undefined} value
 * @param {number} nowMs milliseconds since the epoch
 * @returns {number} milliseconds to wait, at most one day
 */
export function parseRetryAfter(value, nowMs) {
  const v = (value ?? "").trim();
  if (v === "") {
    return 0;
  }
  if (/^\d+$/.test(v)) {
    return Math.min(Number(v) * 1000, maxRetryAfterMs);
  }
  // An HTTP-date names its weekday and GMT; Date.parse alone would take "1" or
  // "2030" as dates.
  if (!/GMT$/.test(v)) {
    return 0;
  }
  const at = Date.parse(v);
  if (Number.isNaN(at) || at <= nowMs) {
    return 0;
  }
  return Math.min(at - nowMs, maxRetryAfterMs);
}

/**
 * The wait before retry number n (1-based) within one round of attempts, with
 * full jitter: a uniformly random time in [0, min(max, base·2^(n-1))], so clients
 * that failed together do not come back together. A server's Retry-After raises
 * the wait to at least that long, with a little jitter on top; one longer than
 * max ends the round instead (see nextStep).
 *
 * @param {number} n the retry's number, 1 for the first retry
 * @param {{base: number, max: number}} shape milliseconds
 * @param {number} [retryAfterMs] the server's Retry-After, 0 for none
 * @param {() => number} [random] a source of [0, 1), Math.random by default
 * @returns {number} milliseconds
 */
export function backoffDelay(n, shape, retryAfterMs = 0, random = Math.random) {
  let ceiling = shape.base;
  for (let i = 1; i < n && ceiling < shape.max; i++) {
    ceiling *= 2;
  }
  ceiling = Math.min(ceiling, shape.max);
  let d = Math.floor(random() * (ceiling + 1));
  const atLeast = Math.min(retryAfterMs, shape.max);
  if (d < atLeast) {
    d = atLeast + Math.floor(random() * (shape.base + 1));
  }
  return d;
}

/**
 * What a round of attempts does after one that got no final answer: "retry"
 * within the round after delay milliseconds, or "pause": the round ends, the
 * intent stays pending, and the client sends it again by itself after delay
 * (the server's Retry-After) or, when delay is 0, after its re-drive backoff
 * (redriveDelay). A round pauses when its attempts are spent, and at once when
 * the server asks for a wait longer than a round's backoff allows.
 *
 * @param {number} n the attempt's number within its round, 1-based
 * @param {number} budget the round's attempts
 * @param {{base: number, max: number}} shape the round's backoff, milliseconds
 * @param {number} retryAfterMs the server's Retry-After, 0 for none
 * @param {() => number} [random]
 * @returns {{step: "retry" | "pause", delay: number}}
 */
export function nextStep(n, budget, shape, retryAfterMs, random = Math.random) {
  if (retryAfterMs > shape.max || n >= budget) {
    return { step: "pause", delay: retryAfterMs };
  }
  return { step: "retry", delay: backoffDelay(n, shape, retryAfterMs, random) };
}

/**
 * The wait before the client sends a paused intent again by itself: equal
 * jitter, a uniformly random time in [c/2, c] with c = min(max, first·2^pauses),
 * so a page left open through an outage comes back within max of the service's
 * return, and never hammers it (at least first/2 apart).
 *
 * @param {number} pauses the pauses before this one, 0 for the first
 * @param {{first: number, max: number}} shape milliseconds
 * @param {() => number} [random]
 * @returns {number} milliseconds
 */
export function redriveDelay(pauses, shape, random = Math.random) {
  let ceiling = shape.first;
  for (let i = 0; i < pauses && ceiling < shape.max; i++) {
    ceiling *= 2;
  }
  ceiling = Math.min(ceiling, shape.max);
  const half = Math.floor(ceiling / 2);
  return half + Math.floor(random() * (ceiling - half + 1));
}

/**
 * Says why a pending intent must not be sent again, or returns "" when it may.
 * The server remembers a key for a limited time from its first arrival, which is
 * after createdAt; past lifetimeMs the key may be forgotten and a late retry would
 * be a second effect. A createdAt more than a minute in the future means the clock
 * was set back by an unknown amount, so the age is unknown: that counts as expired
 * too, not as age zero.
 *
 * @param {number} createdAt milliseconds since the epoch, when the intent was journaled
 * @param {number} nowMs
 * @param {number} lifetimeMs
 * @returns {string}
 */
export function expiry(createdAt, nowMs, lifetimeMs) {
  const age = nowMs - createdAt;
  if (age < -clockSkewAllowanceMs) {
    return `created ${new Date(createdAt).toISOString()}, ${Math.round(-age / 1000)} s ahead of the clock: ` +
      "the clock was set back, so the intent's age is unknown and the server may have forgotten its key; " +
      "it is not re-sent, reconcile it by hand";
  }
  if (age >= lifetimeMs) {
    return `created ${Math.round(age / 1000)} s ago, past the key lifetime of ${Math.round(lifetimeMs / 1000)} s: ` +
      "the server may have forgotten its key, so it is not re-sent; reconcile it by hand";
  }
  return "";
}
