// The key names one user intent. It is minted in the browser when the user acts,
// never by the server: a key named in the server's response is lost with that
// response, and the retry could only ask for a new one.

/**
 * Mints a new idempotency key: a UUIDv7 (RFC 9562) of the current time and 74
 * random bits, so keys sort by creation and never repeat.
 *
 * @param {number} [now] milliseconds since the epoch (default: Date.now())
 * @returns {string} the key, e.g. "0192f1c4-6a3b-7d2e-9f10-5c8b2a7e4d31"
 */
export function newKey(now = Date.now()) {
  const b = new Uint8Array(16);
  globalThis.crypto.getRandomValues(b);
  // 48 bits of milliseconds, big-endian. Division, not shifts: JS shifts are 32-bit.
  let t = Math.floor(now);
  for (let i = 5; i >= 0; i--) {
    b[i] = t % 256;
    t = Math.floor(t / 256);
  }
  b[6] = (b[6] & 0x0f) | 0x70; // version 7
  b[8] = (b[8] & 0x3f) | 0x80; // variant 10
  const hex = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}
