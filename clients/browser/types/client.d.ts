/** @typedef {import("./journal.js").IntentRecord} IntentRecord */
/**
 * Where an intent stands, as in package client and `enqueue`'s output: "done" (a
 * 2xx was recorded), "pending" (no final response yet; resume() sends it again
 * with its key), "rejected" (a final 4xx was recorded) or "expired" (pending, but
 * past the key lifetime or of unknown age: never sent again, reconcile it by
 * hand).
 *
 * @typedef {"pending" | "done" | "rejected" | "expired"} IntentStatus
 */
/**
 * The outcome of one intent.
 *
 * @typedef {object} Result
 * @property {string} key names the intent
 * @property {number} attempts sends with the key, across tabs and reloads
 * @property {IntentStatus} status
 * @property {number} httpStatus the final response's status; 0 while pending
 * @property {unknown} response the final response's body, parsed when it is JSON;
 *   undefined while pending
 * @property {boolean} replayed the server answered from its record of the first
 *   arrival (Idempotent-Replayed: true) rather than executing again
 * @property {string} error why the intent needs attention that status does not
 *   spell out (expired, left pending after its attempts or while offline, a
 *   redirect, a 422); "" when none
 * @property {string} method
 * @property {string} url
 * @property {number} createdAt when the intent was journaled, milliseconds since the epoch
 */
/**
 * What happens to an intent, as it happens, for a page to show.
 *
 * - journaled: the intent is on disk; nothing was sent yet.
 * - waiting: another tab (or call) is sending this intent; this one waits for it.
 * - sending: attempt number `attempt` goes out.
 * - failed: the attempt got no final answer (`error`, `httpStatus` when there
 *   was a response); the next one follows after `delay` milliseconds.
 * - offline: the browser is offline; the intent stays pending and is sent when it
 *   is back online.
 * - finished: a final response was recorded (`httpStatus`).
 * - expired: the intent is past the key lifetime and is not sent again.
 * - gone: the intent is no longer in the journal and is not sent again.
 *
 * @typedef {object} IntentEvent
 * @property {"journaled" | "waiting" | "sending" | "failed" | "offline" | "finished" | "expired" | "gone"} type
 * @property {string} key
 * @property {number} [attempt]
 * @property {number} [httpStatus]
 * @property {number} [delay]
 * @property {string} [error]
 */
/**
 * @typedef {object} ClientOptions
 * @property {string} [journal] IndexedDB database of the intents (default "idem").
 *   Clients of one origin that name the same journal share its intents, and
 *   coordinate so that each intent is sent by one of them at a time.
 * @property {string} [baseURL] what request paths are resolved against (default:
 *   the page's origin). Another origin must allow the Idempotency-Key header
 *   (CORS) and expose Idempotent-Replayed.
 * @property {string} [scope] sent as Idempotency-Scope on new intents when not empty
 * @property {number} [maxAttempts] sends per submit() or resume() of one intent
 *   (default 8); the intent stays pending when they run out
 * @property {number} [backoffBase] milliseconds (default 100); see backoffMax
 * @property {number} [backoffMax] milliseconds (default 10000). Retry n waits a
 *   random time up to min(backoffMax, backoffBase·2^(n-1)), or at least a
 *   server's Retry-After, up to backoffMax.
 * @property {number} [timeout] milliseconds one attempt may take, response body
 *   included (default 10000)
 * @property {number} [keyLifetime] milliseconds a pending intent is sent again,
 *   counted from its creation (default 24 h, as package client's
 *   DefaultKeyLifetime). It must be shorter than the server's key lifetimes.
 * @property {number} [pruneAfter] milliseconds a finished intent is kept after its
 *   response (default 7 days); resume() prunes older ones
 * @property {typeof fetch} [fetch] sends the requests (default: the global fetch)
 * @property {(e: IntentEvent) => void} [onEvent] told what happens to each intent
 * @property {boolean} [resumeWhenOnline] resume() whenever the browser comes back
 *   online (default true)
 */
/** The defaults of ClientOptions, in milliseconds where a duration. */
export const defaults: Readonly<{
    journal: "idem";
    maxAttempts: 8;
    backoffBase: 100;
    backoffMax: 10000;
    timeout: 10000;
    keyLifetime: number;
    pruneAfter: number;
}>;
/**
 * One request to submit as a new intent.
 *
 * @typedef {object} SubmitRequest
 * @property {string} path resolved against baseURL, e.g. "/v1/payments"
 * @property {string} [method] default "POST"
 * @property {unknown} [body] a string is sent as it is; anything else as its
 *   JSON. Every attempt sends the same bytes: the server rejects a key reused
 *   with a different body (422).
 */
/**
 * A Client sends intents to an idem service so that each takes effect once. It
 * mints the key when the user acts, journals the intent in IndexedDB before the
 * first send, and sends it again with that key until a final answer arrives, in
 * this tab or, after a reload, a crash or a restore, in the next one.
 */
export class Client {
    /** @param {ClientOptions} [options] */
    constructor(options?: ClientOptions);
    /**
     * Submits a new intent: mints its key, journals it, and only then sends it,
     * retrying with the same key on a timeout, a network error, a 5xx, 408, 409,
     * 425 or 429 (after a jittered backoff, or the server's Retry-After) until a
     * final answer: a 2xx is done, any other 4xx (a 422 key mismatch included) is
     * rejected. Call it once per user act: two calls are two intents.
     *
     * It resolves with the Result, pending when the attempts ran out, the browser
     * is offline or the answer was a redirect (error says which); resume() sends a
     * pending intent again with its key. It rejects when the intent could not be
     * journaled (then it was never sent) and with IntentGoneError when the intent
     * left the journal while it was being sent (then it is not sent again).
     *
     * @param {SubmitRequest} req
     * @returns {Promise<Result>}
     */
    submit(req: SubmitRequest): Promise<Result>;
    /**
     * Sends every pending intent of the journal again, each with its own key: what
     * a page runs when it loads, after a reload, a crash or a restored session. An
     * intent another tab is sending is waited for, not sent twice. Expired intents
     * are not sent. It first prunes finished intents older than pruneAfter.
     *
     * @returns {Promise<Result[]>} one Result per pending intent, oldest first
     */
    resume(): Promise<Result[]>;
    /**
     * Every intent in the journal, oldest first, pending ones past the key
     * lifetime reported as expired. It sends nothing.
     *
     * @returns {Promise<Result[]>}
     */
    list(): Promise<Result[]>;
    /**
     * One intent, or undefined when the journal does not hold its key.
     *
     * @param {string} key
     * @returns {Promise<Result | undefined>}
     */
    status(key: string): Promise<Result | undefined>;
    /**
     * Deletes finished intents whose response arrived longer ago than olderThan
     * milliseconds. Pending and expired intents are kept: their key is still the
     * only name of their intent.
     *
     * @param {number} [olderThan] default pruneAfter
     * @returns {Promise<number>} how many were deleted
     */
    prune(olderThan?: number): Promise<number>;
    /** Stops resuming when online and closes the journal. */
    close(): void;
    #private;
}
/**
 * What one attempt got back.
 */
export type Answer = {
    redirect: boolean;
    status: number;
    location: string;
    body: string;
    replayed: boolean;
    retryAfter: string | null;
};
export type IntentRecord = import("./journal.js").IntentRecord;
/**
 * Where an intent stands, as in package client and `enqueue`'s output: "done" (a
 * 2xx was recorded), "pending" (no final response yet; resume() sends it again
 * with its key), "rejected" (a final 4xx was recorded) or "expired" (pending, but
 * past the key lifetime or of unknown age: never sent again, reconcile it by
 * hand).
 */
export type IntentStatus = "pending" | "done" | "rejected" | "expired";
/**
 * The outcome of one intent.
 */
export type Result = {
    /**
     * names the intent
     */
    key: string;
    /**
     * sends with the key, across tabs and reloads
     */
    attempts: number;
    status: IntentStatus;
    /**
     * the final response's status; 0 while pending
     */
    httpStatus: number;
    /**
     * the final response's body, parsed when it is JSON;
     * undefined while pending
     */
    response: unknown;
    /**
     * the server answered from its record of the first
     * arrival (Idempotent-Replayed: true) rather than executing again
     */
    replayed: boolean;
    /**
     * why the intent needs attention that status does not
     * spell out (expired, left pending after its attempts or while offline, a
     * redirect, a 422); "" when none
     */
    error: string;
    method: string;
    url: string;
    /**
     * when the intent was journaled, milliseconds since the epoch
     */
    createdAt: number;
};
/**
 * What happens to an intent, as it happens, for a page to show.
 *
 * - journaled: the intent is on disk; nothing was sent yet.
 * - waiting: another tab (or call) is sending this intent; this one waits for it.
 * - sending: attempt number `attempt` goes out.
 * - failed: the attempt got no final answer (`error`, `httpStatus` when there
 *   was a response); the next one follows after `delay` milliseconds.
 * - offline: the browser is offline; the intent stays pending and is sent when it
 *   is back online.
 * - finished: a final response was recorded (`httpStatus`).
 * - expired: the intent is past the key lifetime and is not sent again.
 * - gone: the intent is no longer in the journal and is not sent again.
 */
export type IntentEvent = {
    type: "journaled" | "waiting" | "sending" | "failed" | "offline" | "finished" | "expired" | "gone";
    key: string;
    attempt?: number | undefined;
    httpStatus?: number | undefined;
    delay?: number | undefined;
    error?: string | undefined;
};
export type ClientOptions = {
    /**
     * IndexedDB database of the intents (default "idem").
     * Clients of one origin that name the same journal share its intents, and
     * coordinate so that each intent is sent by one of them at a time.
     */
    journal?: string | undefined;
    /**
     * what request paths are resolved against (default:
     * the page's origin). Another origin must allow the Idempotency-Key header
     * (CORS) and expose Idempotent-Replayed.
     */
    baseURL?: string | undefined;
    /**
     * sent as Idempotency-Scope on new intents when not empty
     */
    scope?: string | undefined;
    /**
     * sends per submit() or resume() of one intent
     * (default 8); the intent stays pending when they run out
     */
    maxAttempts?: number | undefined;
    /**
     * milliseconds (default 100); see backoffMax
     */
    backoffBase?: number | undefined;
    /**
     * milliseconds (default 10000). Retry n waits a
     * random time up to min(backoffMax, backoffBase·2^(n-1)), or at least a
     * server's Retry-After, up to backoffMax.
     */
    backoffMax?: number | undefined;
    /**
     * milliseconds one attempt may take, response body
     * included (default 10000)
     */
    timeout?: number | undefined;
    /**
     * milliseconds a pending intent is sent again,
     * counted from its creation (default 24 h, as package client's
     * DefaultKeyLifetime). It must be shorter than the server's key lifetimes.
     */
    keyLifetime?: number | undefined;
    /**
     * milliseconds a finished intent is kept after its
     * response (default 7 days); resume() prunes older ones
     */
    pruneAfter?: number | undefined;
    /**
     * sends the requests (default: the global fetch)
     */
    fetch?: typeof fetch | undefined;
    /**
     * told what happens to each intent
     */
    onEvent?: ((e: IntentEvent) => void) | undefined;
    /**
     * resume() whenever the browser comes back
     * online (default true)
     */
    resumeWhenOnline?: boolean | undefined;
};
/**
 * One request to submit as a new intent.
 */
export type SubmitRequest = {
    /**
     * resolved against baseURL, e.g. "/v1/payments"
     */
    path: string;
    /**
     * default "POST"
     */
    method?: string | undefined;
    /**
     * a string is sent as it is; anything else as its
     * JSON. Every attempt sends the same bytes: the server rejects a key reused
     * with a different body (422).
     */
    body?: unknown;
};
