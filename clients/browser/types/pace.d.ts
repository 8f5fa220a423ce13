/** Hands out slots, first come first served. */
export class Pacer {
    /** @param {number} limit slots, at least 1 */
    constructor(limit: number);
    /**
     * Waits for a slot; the function it resolves with gives the slot back (once,
     * however often it is called).
     *
     * @returns {Promise<() => void>}
     */
    acquire(): Promise<() => void>;
    /** How many callers wait for a slot. */
    get waiting(): number;
    #private;
}
