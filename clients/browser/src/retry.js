// When to send again, and how long to wait first. Pure functions of their
// arguments, so they are tested under Node without a browser.

/** The longest wait a Retry-After can ask for: one day, as package client. */
const maxRetryAfterMs = 24 * 60 * 60 * 1000;

/**
 * How far ahead of the clock a journaled createdAt may be and still count as age
 * zero: clock jitter, not a clock set back by hours.
 */
export const clockSkewAllowanceMs = 60 * 1000;

/**
 * Reports whether an HTTP status leaves the outcome open, so the same request is
 * sent again with the same key. 5xx: the server failed, perhaps before committing.
 * 409: the first arrival with this key is still running. 408, 425 and 429: the
 * server asks the client to come back. Any other status is the server's answer.
 *
 * @param {number} status
 * @returns {boolean}
 */
export function retryable(status) {
  return status >= 500 || status === 408 || status === 409 || status === 425 || status === 429;
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
 * The wait before retry number n (1-based), with full jitter: a uniformly random
 * time in [0, min(max, base·2^(n-1))], so clients that failed together do not come
 * back together. A server's Retry-After raises the wait to at least that long,
 * capped at max so one response cannot park the client for hours, with a little
 * jitter on top.
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
