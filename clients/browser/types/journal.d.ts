/** The intent is not in the journal: the journal was wiped, or it never held it. */
export class IntentGoneError extends Error {
    /** @param {string} key */
    constructor(key: string);
    /** The key of the intent that is gone. */
    key: string;
}
/**
 * The IndexedDB journal of intents. Writes that a key depends on (a new intent, a
 * final response) commit with strict durability, flushed to disk before they
 * resolve. Another tab or the user may delete the database at any time (clearing
 * the site's data): the journal then closes its connection and opens a fresh one
 * on its next call.
 */
export class Journal {
    /** @param {string} name the IndexedDB database name */
    constructor(name: string);
    /** The IndexedDB database name. */
    get name(): string;
    /**
     * Records a new pending intent. It resolves only once the record is on disk: the
     * key may go on the wire right after. It fails for a key the journal holds.
     *
     * @param {IntentRecord} rec
     * @returns {Promise<void>}
     */
    append(rec: IntentRecord): Promise<void>;
    /**
     * Counts one more attempt of a pending intent, before it is sent. It resolves
     * with the record after the change; a finished intent is returned unchanged (it
     * must not be sent again). It rejects with IntentGoneError for a key the
     * journal does not hold.
     *
     * @param {string} key
     * @returns {Promise<IntentRecord>}
     */
    recordAttempt(key: string): Promise<IntentRecord>;
    /**
     * Records the final response. An intent already finished (by another tab) keeps
     * its first response, which is returned. It rejects with IntentGoneError for a
     * key the journal does not hold.
     *
     * @param {string} key
     * @param {{status: "done" | "rejected", httpStatus: number, response: string, replayed: boolean}} fin
     * @returns {Promise<IntentRecord>}
     */
    finish(key: string, fin: {
        status: "done" | "rejected";
        httpStatus: number;
        response: string;
        replayed: boolean;
    }): Promise<IntentRecord>;
    /**
     * @param {string} key
     * @returns {Promise<IntentRecord | undefined>}
     */
    get(key: string): Promise<IntentRecord | undefined>;
    /**
     * Every intent, oldest first.
     *
     * @returns {Promise<IntentRecord[]>}
     */
    all(): Promise<IntentRecord[]>;
    /**
     * The intents without a final response, oldest first.
     *
     * @returns {Promise<IntentRecord[]>}
     */
    pending(): Promise<IntentRecord[]>;
    /**
     * Deletes finished intents whose response arrived before the given time. Pending
     * intents are never pruned: their key is still needed.
     *
     * @param {number} beforeMs milliseconds since the epoch
     * @returns {Promise<number>} how many were deleted
     */
    prune(beforeMs: number): Promise<number>;
    /** Closes the connection; the next call opens it again. */
    close(): void;
    #private;
}
/**
 * What the journal records. "expired" is never stored: it is derived from
 * createdAt when an intent is listed or about to be sent.
 */
export type StoredStatus = "pending" | "done" | "rejected";
/**
 * One intent as the journal keeps it.
 */
export type IntentRecord = {
    /**
     * the idempotency key, minted before the first send
     */
    key: string;
    /**
     * sent as Idempotency-Scope when not empty
     */
    scope: string;
    method: string;
    /**
     * the absolute URL
     */
    url: string;
    /**
     * byte for byte what every attempt sends
     */
    body: string;
    /**
     * when it was journaled, milliseconds since the epoch
     */
    createdAt: number;
    /**
     * sends started with this key, across tabs and reloads
     */
    attempts: number;
    status: StoredStatus;
    /**
     * the final response's status
     */
    httpStatus?: number | undefined;
    /**
     * the final response's body
     */
    response?: string | undefined;
    /**
     * the server answered from its record of the first arrival
     */
    replayed?: boolean | undefined;
    /**
     * when the final response was recorded
     */
    finishedAt?: number | undefined;
};
