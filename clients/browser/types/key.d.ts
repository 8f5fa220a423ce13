/**
 * Mints a new idempotency key: a UUIDv7 (RFC 9562) of the current time and 74
 * random bits, so keys sort by creation and never repeat.
 *
 * @param {number} [now] milliseconds since the epoch (default: Date.now())
 * @returns {string} the key, e.g. "0192f1c4-6a3b-7d2e-9f10-5c8b2a7e4d31"
 */
export function newKey(now?: number): string;
