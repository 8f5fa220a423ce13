// A bound on the requests one client has on the wire at once. A browser keeps
// at most six HTTP/1.1 connections per host and queues the rest, unseen by the
// page: an intent that waits in that queue would spend its timeout there, and
// be sent again while its first copy is still to leave. Below the bound, the
// wait is the client's own, before the attempt's clock starts.

/** Hands out slots, first come first served. */
export class Pacer {
  /** @type {number} */
  #free;
  /** @type {(() => void)[]} */
  #waiting = [];

  /** @param {number} limit slots, at least 1 */
  constructor(limit) {
    if (!(Number.isInteger(limit) && limit >= 1)) {
      throw new RangeError(`idem: a pacer needs a whole number of slots, at least 1, got ${limit}`);
    }
    this.#free = limit;
  }

  /**
   * Waits for a slot; the function it resolves with gives the slot back (once,
   * however often it is called).
   *
   * @returns {Promise<() => void>}
   */
  async acquire() {
    if (this.#free > 0) {
      this.#free--;
    } else {
      await new Promise((resolve) => this.#waiting.push(() => resolve(undefined)));
    }
    let held = true;
    return () => {
      if (!held) {
        return;
      }
      held = false;
      const next = this.#waiting.shift();
      if (next) {
        next(); // the slot passes straight on
      } else {
        this.#free++;
      }
    };
  }

  /** How many callers wait for a slot. */
  get waiting() {
    return this.#waiting.length;
  }
}
