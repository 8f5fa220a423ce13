// What a server's answer says: its error code, the message an application
// shows for it, and the server's clock. Pure functions, tested under Node.

/**
 * The codes with which a server refuses a key for its age. The key carries the
 * time it was minted (UUIDv7), so the likely cause of such a refusal for a fresh
 * intent is this device's clock. These requests were not run.
 */
export const keyAgeCodes = Object.freeze(["idempotency_key_expired", "idempotency_key_clock_skew"]);

/**
 * The error code a response body names: the string "code" member of a JSON
 * object (idem's errors are {"error": "...", "code": "..."}), or that of its
 * "error" object (the {"error": {"code": "..."}} of Stripe and others); for an
 * RFC 9457 problem (application/problem+json) its "code" extension member, or
 * else its "type" URI. "" when the body names none.
 *
 * @param {string} body
 * @param {string} [contentType]
 * @returns {string}
 */
export function errorCode(body, contentType = "") {
  const doc = jsonObject(body);
  if (!doc) {
    return "";
  }
  if (typeof doc.code === "string") {
    return doc.code;
  }
  const inner = doc.error;
  if (inner && typeof inner === "object" && typeof (/** @type {Record<string, unknown>} */ (inner)).code === "string") {
    return /** @type {string} */ ((/** @type {Record<string, unknown>} */ (inner)).code);
  }
  if (/^application\/problem\+json\b/i.test(contentType) && typeof doc.type === "string" && doc.type !== "about:blank") {
    return doc.type;
  }
  return "";
}

/**
 * The server's own words for a refusal, when its body has them: idem's "error"
 * string, Stripe's error.message, a problem's detail or title. At most 200
 * characters.
 *
 * @param {string} body
 * @returns {string}
 */
export function errorMessage(body) {
  const doc = jsonObject(body);
  if (!doc) {
    return "";
  }
  const inner = doc.error && typeof doc.error === "object" ? /** @type {Record<string, unknown>} */ (doc.error) : {};
  for (const v of [doc.error, inner.message, doc.detail, doc.message, doc.title]) {
    if (typeof v === "string" && v.trim() !== "") {
      const s = v.trim();
      return s.length > 200 ? `${s.slice(0, 200)}...` : s;
    }
  }
  return "";
}

/**
 * The name a code is matched by: a problem type URI is matched by its last
 * segment ("https://example.com/problems/idempotency_key_expired" is
 * "idempotency_key_expired").
 *
 * @param {string} code
 * @returns {string}
 */
export function codeName(code) {
  const m = /[^/#]+$/.exec(code.replace(/[/#]+$/, ""));
  return m ? m[0] : code;
}

/**
 * Reports whether a refusal names the key's age (keyAgeCodes).
 *
 * @param {string} code
 * @returns {boolean}
 */
export function isKeyAgeCode(code) {
  return keyAgeCodes.includes(codeName(code));
}

/**
 * Why a final refusal happened, in words chosen by the server's code, for a
 * developer or a log: an application maps Result.code to its users' words.
 *
 * @param {number} status
 * @param {string} code
 * @param {string} serverMessage the server's own words ("" for none)
 * @returns {string}
 */
export function rejectionMessage(status, code, serverMessage) {
  const name = codeName(code);
  const head = `HTTP ${status}${code ? ` ${code}` : ""}`;
  const tail = serverMessage ? ` (the server says: ${serverMessage})` : "";
  if (isKeyAgeCode(name)) {
    return `${head}: the server refused the key as older than it remembers keys, and did not run the request. ` +
      "The likely cause is this device's clock: a key carries the time it was minted, so a clock far behind the " +
      `server's makes a fresh key look old. Set the clock right, then submit again${tail}`;
  }
  switch (name) {
    case "idempotency_key_mismatch":
      return `${head}: the server holds this key for a different request (method, path or body); ` +
        `a key is never reused for another body, so this intent stays rejected${tail}`;
    case "missing_idempotency_key":
    case "malformed_idempotency_key":
    case "malformed_idempotency_scope":
    case "idempotency_scope_not_accepted":
      return `${head}: the server refused the request's idempotency headers; it ran nothing${tail}`;
    case "body_too_large":
      return `${head}: the request's body is larger than the server accepts; it ran nothing${tail}`;
    default:
      return `${head}: the server's final answer; the intent is not sent again${tail}`;
  }
}

/**
 * How far the server's clock is ahead of this device's (negative when behind),
 * read from a response's Date header (RFC 9110, one-second resolution); null
 * without a usable header.
 *
 * @param {string | null | undefined} dateHeader
 * @param {number} nowMs this device's clock when the response arrived
 * @returns {number | null} milliseconds
 */
export function clockOffset(dateHeader, nowMs) {
  const v = (dateHeader ?? "").trim();
  if (!/GMT$/.test(v)) {
    return null;
  }
  const at = Date.parse(v);
  return Number.isNaN(at) ? null : at - nowMs;
}

/**
 * What a page on pageOrigin must get from a service on apiOrigin for the browser
 * to let it read the service's answers: the CORS contract, in one sentence.
 *
 * @param {string} pageOrigin
 * @param {string} apiOrigin
 * @returns {string}
 */
export function corsContract(pageOrigin, apiOrigin) {
  return `${apiOrigin} must answer the preflight (OPTIONS) with Access-Control-Allow-Origin: ${pageOrigin}, ` +
    "Access-Control-Allow-Methods naming the method, and Access-Control-Allow-Headers: Idempotency-Key, " +
    "Idempotency-Scope, Content-Type (and any header the page adds); and put Access-Control-Allow-Origin " +
    "on the actual response too, with Access-Control-Expose-Headers: Idempotent-Replayed, Retry-After, Date";
}

/**
 * @param {string} body
 * @returns {Record<string, unknown> | null}
 */
function jsonObject(body) {
  try {
    const doc = JSON.parse(body);
    return doc && typeof doc === "object" && !Array.isArray(doc) ? doc : null;
  } catch {
    return null;
  }
}
