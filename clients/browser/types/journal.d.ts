/** The intent is not in the journal: the journal was wiped, or it never held it. */
export class IntentGoneError extends Error {
    /** @param {string} key */
    constructor(key: string);
    /** The key of the intent that is gone. */
    key: string;
    /** The status of the last answer the intent got before it left the journal; 0 for none. */
    httpStatus: number;
    /** That answer's body, parsed when it is JSON; undefined for none. */
    /** @type {unknown} */
    response: unknown;
}
/**
 * The journal cannot be used: no IndexedDB in this context, storage blocked or
 * full, a failing disk. `reason` says which in words; `cause` is the browser's
 * error.
 */
export class JournalUnavailableError extends Error {
    /**
     * @param {string} journal the IndexedDB database name
     * @param {unknown} cause
     */
    constructor(journal: string, cause: unknown);
    /** Why, in words. */
    reason: string;
    /** The IndexedDB database name. */
    journal: string;
}
/**
 * The IndexedDB journal of intents. Writes that a key depends on (a new intent, a
 * final response) ask for strict durability: the browser flushes them to disk
 * before they resolve, where it honours the hint. Another tab or the user may
 * delete the database at any time (clearing the site's data): the journal then
 * closes its connection and opens a fresh one on its next call.
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
     * @param {number} at when the attempt starts
     * @returns {Promise<IntentRecord>}
     */
    recordAttempt(key: string, at: number): Promise<IntentRecord>;
    /**
     * Records when a pending intent is sent next and why its last attempt failed.
     * A finished intent is returned unchanged. It rejects with IntentGoneError for
     * a key the journal does not hold.
     *
     * @param {string} key
     * @param {{retryAt: number, pauses: number, cause: FailureCause, lastError: string}} next
     * @returns {Promise<IntentRecord>}
     */
    schedule(key: string, next: {
        retryAt: number;
        pauses: number;
        cause: FailureCause;
        lastError: string;
    }): Promise<IntentRecord>;
    /**
     * Records the final response. Unless keep is set, the intent's body, headers
     * and response body are dropped: what stays is its key, status, HTTP status,
     * error code and times. An intent already finished (by another tab) keeps its
     * first response: then first is false and rec is that one. It rejects with
     * IntentGoneError for a key the journal does not hold.
     *
     * @param {string} key
     * @param {{status: "done" | "rejected", httpStatus: number, code: string, response: string, replayed: boolean, lastError: string}} fin
     * @param {boolean} keep
     * @returns {Promise<{rec: IntentRecord, first: boolean}>}
     */
    finish(key: string, fin: {
        status: "done" | "rejected";
        httpStatus: number;
        code: string;
        response: string;
        replayed: boolean;
        lastError: string;
    }, keep: boolean): Promise<{
        rec: IntentRecord;
        first: boolean;
    }>;
    /**
     * Replaces a pending intent by the same intent under a new key, in one
     * transaction. It rejects with IntentGoneError when the old key is gone or
     * finished.
     *
     * @param {string} oldKey
     * @param {IntentRecord} next
     * @returns {Promise<void>}
     */
    rekey(oldKey: string, next: IntentRecord): Promise<void>;
    /**
     * @param {string} key
     * @returns {Promise<IntentRecord | undefined>}
     */
    get(key: string): Promise<IntentRecord | undefined>;
    /**
     * The intents of one owner, oldest first.
     *
     * @param {string} owner
     * @returns {Promise<IntentRecord[]>}
     */
    all(owner: string): Promise<IntentRecord[]>;
    /**
     * The intents of one owner without a final response, oldest first.
     *
     * @param {string} owner
     * @returns {Promise<IntentRecord[]>}
     */
    pending(owner: string): Promise<IntentRecord[]>;
    /**
     * Deletes one intent of an owner.
     *
     * @param {string} key
     * @param {string} owner
     * @returns {Promise<boolean>} whether it was there
     */
    forget(key: string, owner: string): Promise<boolean>;
    /**
     * Deletes every intent of an owner.
     *
     * @param {string} owner
     * @returns {Promise<string[]>} their keys
     */
    clear(owner: string): Promise<string[]>;
    /**
     * Deletes, whoever owns them, finished intents whose response arrived before
     * finishedBefore, and pending ones whose age (either way, for a clock set
     * back) is past staleAfter: they are past their key lifetime, never sent
     * again, and kept only that long for someone to reconcile them.
     *
     * @param {{finishedBefore: number, now: number, staleAfter: number}} bounds milliseconds
     * @returns {Promise<number>} how many were deleted
     */
    prune(bounds: {
        finishedBefore: number;
        now: number;
        staleAfter: number;
    }): Promise<number>;
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
 * Why the last attempt got no final answer: "network" (no answer: the service
 * is unreachable or the connection broke), "cors" (the service answered, but the
 * browser hid the answer from the page: its CORS configuration), "timeout",
 * "http" (a 5xx, 408, 409 in progress, 425 or 429), "redirect" (not followed),
 * "offline" (not sent: the browser is offline), "clock" (refused for the key's
 * age: this device's clock), or "" (none yet).
 */
export type FailureCause = "" | "network" | "cors" | "timeout" | "http" | "redirect" | "offline" | "clock";
/**
 * One intent as the journal keeps it. A finished intent keeps its key, status,
 * HTTP status and error code; its body, headers and response are dropped when
 * it finishes, unless the client keeps responses.
 */
export type IntentRecord = {
    /**
     * the idempotency key, minted before the first send
     */
    key: string;
    /**
     * whose intent it is: only a client of this owner sends,
     * lists or forgets it
     */
    owner: string;
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
    body?: string | undefined;
    /**
     * the body's Content-Type
     */
    contentType?: string | undefined;
    /**
     * the request's own headers, sent
     * with every attempt
     */
    headers?: Record<string, string> | undefined;
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
     * when the latest attempt started
     */
    lastAttemptAt?: number | undefined;
    /**
     * when a client sends the pending intent again by
     * itself; 0 when none will (offline, or no client re-drives it)
     */
    retryAt?: number | undefined;
    /**
     * how often its rounds of attempts ended with it pending
     */
    pauses?: number | undefined;
    /**
     * why the last attempt got no final answer
     */
    cause?: FailureCause | undefined;
    /**
     * what the last attempt got, or why it was refused
     */
    lastError?: string | undefined;
    /**
     * the key it was first sent with, when it was
     * sent again under a new key because the server refused the first for its age
     */
    previousKey?: string | undefined;
    /**
     * the final response's status
     */
    httpStatus?: number | undefined;
    /**
     * the final response's error code
     */
    code?: string | undefined;
    /**
     * the final response's body, when kept
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
