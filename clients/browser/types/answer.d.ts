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
export function errorCode(body: string, contentType?: string): string;
/**
 * The server's own words for a refusal, when its body has them: idem's "error"
 * string, Stripe's error.message, a problem's detail or title. At most 200
 * characters.
 *
 * @param {string} body
 * @returns {string}
 */
export function errorMessage(body: string): string;
/**
 * The name a code is matched by: a problem type URI is matched by its last
 * segment ("https://example.com/problems/idempotency_key_expired" is
 * "idempotency_key_expired").
 *
 * @param {string} code
 * @returns {string}
 */
export function codeName(code: string): string;
/**
 * Reports whether a refusal names the key's age (keyAgeCodes).
 *
 * @param {string} code
 * @returns {boolean}
 */
export function isKeyAgeCode(code: string): boolean;
/**
 * Why a final refusal happened, in words chosen by the server's code, for a
 * developer or a log: an application maps Result.code to its users' words.
 *
 * @param {number} status
 * @param {string} code
 * @param {string} serverMessage the server's own words ("" for none)
 * @returns {string}
 */
export function rejectionMessage(status: number, code: string, serverMessage: string): string;
/**
 * How far the server's clock is ahead of this device's (negative when behind),
 * read from a response's Date header (RFC 9110, one-second resolution); null
 * without a usable header.
 *
 * @param {string | null | undefined} dateHeader
 * @param {number} nowMs this device's clock when the response arrived
 * @returns {number | null} milliseconds
 */
export function clockOffset(dateHeader: string | null | undefined, nowMs: number): number | null;
/**
 * What a page on pageOrigin must get from a service on apiOrigin for the browser
 * to let it read the service's answers: the CORS contract, in one sentence.
 *
 * @param {string} pageOrigin
 * @param {string} apiOrigin
 * @returns {string}
 */
export function corsContract(pageOrigin: string, apiOrigin: string): string;
/**
 * The codes with which a server refuses a key for its age. The key carries the
 * time it was minted (UUIDv7), so the likely cause of such a refusal for a fresh
 * intent is this device's clock. These requests were not run.
 */
export const keyAgeCodes: readonly string[];
