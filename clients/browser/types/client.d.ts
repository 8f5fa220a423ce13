/** @typedef {import("./journal.js").IntentRecord} IntentRecord */
/** @typedef {import("./journal.js").FailureCause} FailureCause */
/** @typedef {import("./retry.js").AnswerInfo} AnswerInfo */
/**
 * Where an intent stands, as in package client and `enqueue`'s output: "done" (a
 * 2xx was recorded), "pending" (no final response yet; it is sent again with its
 * key), "rejected" (a final 4xx was recorded) or "expired" (pending, but past the
 * key lifetime or of unknown age: never sent again, reconcile it by hand).
 *
 * @typedef {"pending" | "done" | "rejected" | "expired"} IntentStatus
 */
/**
 * The outcome of one intent.
 *
 * @typedef {object} Result
 * @property {string} key names the intent
 * @property {number} attempts sends with the key, as this browser counts them
 *   (across tabs and reloads); the browser itself may repeat a request after a
 *   broken connection, so the server's count is the one to trust
 * @property {IntentStatus} status
 * @property {number} httpStatus the final response's status; 0 while pending
 * @property {string} code the error code of the final response's body ("" for
 *   none): JSON "code" (or "error.code"), or an RFC 9457 problem's "code" or
 *   "type"
 * @property {unknown} response the final response's body, parsed when it is JSON;
 *   undefined while pending, and once dropped from the journal (keepResponses)
 * @property {boolean} replayed the server answered from its record of the first
 *   arrival (Idempotent-Replayed: true) rather than executing again
 * @property {string} error why the intent needs attention, for a developer or a
 *   log: the last failure of a pending intent, a refusal's reason (chosen by
 *   code), why it expired; "" when none
 * @property {FailureCause} cause why the last attempt got no final answer
 * @property {number} retryAt when this browser sends the pending intent again by
 *   itself, milliseconds since the epoch; 0 when nothing will (offline: it goes
 *   out when the browser is back online; or re-driving is off)
 * @property {string} previousKey the key the intent was first sent with, when the
 *   server refused that key for its age and it was sent again under this one; ""
 * @property {string} method
 * @property {string} url
 * @property {number} createdAt when the intent was journaled, milliseconds since the epoch
 */
/**
 * What happens to an intent, as it happens, for a page to show. Each client
 * also hears what the other tabs' clients of its journal and owner do, marked
 * otherTab.
 *
 * - journaled: the intent is on disk; nothing was sent yet.
 * - waiting: another tab (or call) is sending this intent; this one waits for it.
 * - sending: attempt number `attempt` goes out.
 * - failed: the attempt got no final answer (`error`, `cause`, `httpStatus` when
 *   there was a response). With `delay` (and `retryAt`) the next attempt follows
 *   that much later; without, a paused or exhausted event follows.
 * - paused: the round of attempts ended with the intent pending; the client
 *   sends it again by itself at `retryAt` (sooner when the browser comes back
 *   online, the page is shown again or gets focus, or on retry(key)).
 * - exhausted: the round ended with the intent pending, and nothing in this page
 *   sends it again by itself (re-driving is off, or the client was closed):
 *   resume() or retry(key) does.
 * - offline: the browser is offline; the intent stays pending and is sent when it
 *   is back online.
 * - rekeyed: the server refused the key for its age because this device's clock
 *   is wrong; the same intent goes out again under `key`, its first key
 *   `previousKey` never having taken effect.
 * - finished: a final response was recorded (`httpStatus`, `code`), by another
 *   tab when otherTab.
 * - expired: the intent is past the key lifetime and is not sent again.
 * - gone: the intent is no longer in the journal and is not sent again.
 * - forgotten: forget(key) or clear() deleted the intent.
 *
 * @typedef {object} IntentEvent
 * @property {"journaled" | "waiting" | "sending" | "failed" | "paused" | "exhausted" | "offline" | "rekeyed" | "finished" | "expired" | "gone" | "forgotten"} type
 * @property {string} key
 * @property {number} [attempt]
 * @property {number} [httpStatus]
 * @property {string} [code]
 * @property {number} [delay] milliseconds until the next attempt
 * @property {number} [retryAt] when the next attempt goes out, milliseconds since the epoch
 * @property {string} [error]
 * @property {FailureCause} [cause]
 * @property {string} [previousKey]
 * @property {boolean} [otherTab] another tab's client did this
 */
/**
 * @typedef {object} ClientOptions
 * @property {string} [journal] IndexedDB database of the intents (default "idem").
 *   Clients of one origin that name the same journal share its intents, and
 *   coordinate so that each intent is sent by one of them at a time.
 * @property {string} [owner] whose intents this client sends, lists and forgets:
 *   the signed-in user (default: scope). Each intent is journaled under its
 *   owner; a client never touches another owner's intents.
 * @property {string} [baseURL] what request paths are resolved against (default:
 *   the page's origin). Another origin must follow the CORS contract in the
 *   README.
 * @property {string} [scope] sent as Idempotency-Scope on new intents when not empty
 * @property {number} [maxAttempts] sends per round of submit(), resume() or
 *   retry() (default 8); then the intent is paused, and sent again by the
 *   client's re-drive
 * @property {number} [backoffBase] milliseconds (default 100); see backoffMax
 * @property {number} [backoffMax] milliseconds (default 10000). Retry n of a
 *   round waits a random time up to min(backoffMax, backoffBase·2^(n-1)), or at
 *   least a server's Retry-After; a Retry-After longer than backoffMax pauses the
 *   intent until then.
 * @property {boolean} [redrive] keep sending paused intents while the page is
 *   open: one attempt at a time, redriveMax apart at most, and at once when the
 *   browser comes back online, the page is shown again or gets focus (default
 *   true)
 * @property {number} [redriveMax] milliseconds (default 30000): the wait between
 *   the re-drive's attempts starts near backoffMax and doubles up to this
 * @property {number} [concurrency] requests resume() and the re-drive have on
 *   the wire at once (default 4, below the six connections a browser opens to
 *   one host); submit() and retry() are sent at once
 * @property {number} [timeout] milliseconds one attempt may take from the moment
 *   it is sent, response body included (default 10000)
 * @property {number} [keyLifetime] milliseconds a pending intent is sent again,
 *   counted from its creation (default 24 h, as package client's
 *   DefaultKeyLifetime). It must be shorter than the server's key lifetimes.
 * @property {number} [pruneAfter] milliseconds a finished intent is kept after its
 *   response, and an expired one after its key lifetime (default 7 days);
 *   resume() prunes older ones
 * @property {boolean} [keepResponses] keep a finished intent's body, headers and
 *   response in the journal until it is pruned (default false: dropped when it
 *   finishes; its key, status, HTTP status and code stay)
 * @property {() => Record<string, string> | Promise<Record<string, string>>} [headers]
 *   headers added to every attempt, asked afresh each time and never journaled:
 *   an Authorization or a CSRF token
 * @property {RequestCredentials} [credentials] the fetch credentials mode
 *   (default "same-origin"; "include" sends cookies to another origin)
 * @property {(a: AnswerInfo) => boolean | undefined} [shouldRetry] decides
 *   whether an answer leaves the outcome open (true: sent again with the key) or
 *   is final (false); undefined falls back to the default (5xx, 408, 425, 429,
 *   and 409 with the in-progress code or a Retry-After)
 * @property {typeof fetch} [fetch] sends the requests (default: the global fetch)
 * @property {(e: IntentEvent) => void} [onEvent] told what happens to each intent
 */
/** The defaults of ClientOptions, in milliseconds where a duration. */
export const defaults: Readonly<{
    journal: "idem";
    maxAttempts: 8;
    backoffBase: 100;
    backoffMax: 10000;
    redriveMax: 30000;
    concurrency: 4;
    timeout: 10000;
    keyLifetime: number;
    pruneAfter: number;
}>;
/**
 * How the client comes to send an intent: "user" (submit, retry: always, at
 * once), "trigger" (resume and wake-ups: unless someone attempted it since
 * `at`), "due" (the re-drive's timer for `at`: unless it was rescheduled).
 *
 * @typedef {{kind: "user"} | {kind: "trigger", at: number} | {kind: "due", at: number}} Drive
 */
/**
 * What one attempt got.
 *
 * @typedef {{kind: "error", cause: FailureCause, error: string}
 *   | {kind: "redirect", status: number, location: string}
 *   | {kind: "response", status: number, body: string, code: string, replayed: boolean, retryAfterMs: number, retryAfter: boolean, date: string | null}} Outcome
 */
/**
 * A Client sends intents to an idem service so that each takes effect once. It
 * mints the key when the user acts, journals the intent in IndexedDB before the
 * first send, and sends it again with that key until a final answer arrives:
 * in this page, which keeps at it while it is open, or, after a reload, a crash
 * or a restore, in the next one.
 */
export class Client {
    /** @param {ClientOptions} [options] */
    constructor(options?: ClientOptions);
    /**
     * Whether the tabs of this origin coordinate their sends (Web Locks, which
     * need a secure context). Without, two tabs may send one intent at once; the
     * server still folds them by the key.
     */
    get coordinated(): boolean;
    /** Whose intents this client sends, lists and forgets. */
    get owner(): string;
    /**
     * Submits a new intent: mints its key, journals it, and only then sends it,
     * retrying with the same key on a timeout, a network error, a 5xx, 408, 425,
     * 429 or a 409 that says the first arrival still runs (after a jittered
     * backoff, or the server's Retry-After) until a final answer: a 2xx is done,
     * any other 4xx is rejected. Call it once per user act: two calls are two
     * intents.
     *
     * It resolves with the Result once the answer is final, or once the round's
     * attempts are spent, the browser is offline or the answer was a redirect:
     * then the intent is pending (error and cause say why) and, while the page is
     * open, the client keeps sending it by itself (retryAt says when next). It
     * rejects with JournalUnavailableError when the intent could not be journaled
     * (then nothing was sent), and with IntentGoneError when the intent left the
     * journal before a final answer came (then it is not sent again).
     *
     * @param {SubmitRequest} req
     * @returns {Promise<Result>}
     */
    submit(req: SubmitRequest): Promise<Result>;
    /**
     * Sends every pending intent of this owner again, each with its own key: what
     * a page runs when it loads, or once the user has signed in, after a reload, a
     * crash or a restored session. An intent another tab is sending is waited for,
     * not sent twice. Expired intents are not sent. It first prunes (see prune).
     * Requests go out `concurrency` at a time.
     *
     * @returns {Promise<Result[]>} one Result per pending intent, oldest first
     */
    resume(): Promise<Result[]>;
    /**
     * Sends one pending intent of this owner now, with its key, whatever its
     * re-drive's schedule: a "Try again now" button. It resolves as submit does,
     * or with undefined when the journal holds no such intent of this owner; a
     * finished one is returned as it is.
     *
     * @param {string} key
     * @returns {Promise<Result | undefined>}
     */
    retry(key: string): Promise<Result | undefined>;
    /**
     * Every intent of this owner in the journal, oldest first, pending ones past
     * the key lifetime reported as expired. It sends nothing.
     *
     * @returns {Promise<Result[]>}
     */
    list(): Promise<Result[]>;
    /**
     * One intent of this owner, or undefined when the journal holds no such one.
     *
     * @param {string} key
     * @returns {Promise<Result | undefined>}
     */
    status(key: string): Promise<Result | undefined>;
    /**
     * Deletes one intent of this owner from the journal, pending or not, and stops
     * sending it. A pending intent forgotten may still have taken effect.
     *
     * @param {string} key
     * @returns {Promise<boolean>} whether the journal held it
     */
    forget(key: string): Promise<boolean>;
    /**
     * Deletes every intent of this owner from the journal and stops sending them:
     * call it when the user signs out, so that nothing of theirs is sent under the
     * next user's session, and their bodies do not stay on the device. Pending
     * intents (list() shows them) may still have taken effect, or may not: tell
     * the user before.
     *
     * @returns {Promise<number>} how many were deleted
     */
    clear(): Promise<number>;
    /**
     * Deletes, whoever owns them, finished intents whose response arrived longer
     * ago than olderThan milliseconds, and expired ones past their key lifetime by
     * that much. Pending intents within their lifetime are kept: their key is
     * still the only name of their intent.
     *
     * @param {number} [olderThan] default pruneAfter
     * @returns {Promise<number>} how many were deleted
     */
    prune(olderThan?: number): Promise<number>;
    /**
     * Asks the browser to keep this origin's storage, the journal with it, under
     * storage pressure (navigator.storage.persist()); without, the journal is
     * best-effort: the browser may evict it. Some browsers ask the user, so call
     * it on a user's act. It resolves with whether storage is persistent (false
     * where the API is missing).
     *
     * @returns {Promise<boolean>}
     */
    persist(): Promise<boolean>;
    /** Stops sending, stops hearing other tabs, and closes the journal. */
    close(): void;
    #private;
}
export type IntentRecord = import("./journal.js").IntentRecord;
export type FailureCause = import("./journal.js").FailureCause;
export type AnswerInfo = import("./retry.js").AnswerInfo;
/**
 * Where an intent stands, as in package client and `enqueue`'s output: "done" (a
 * 2xx was recorded), "pending" (no final response yet; it is sent again with its
 * key), "rejected" (a final 4xx was recorded) or "expired" (pending, but past the
 * key lifetime or of unknown age: never sent again, reconcile it by hand).
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
     * sends with the key, as this browser counts them
     * (across tabs and reloads); the browser itself may repeat a request after a
     * broken connection, so the server's count is the one to trust
     */
    attempts: number;
    status: IntentStatus;
    /**
     * the final response's status; 0 while pending
     */
    httpStatus: number;
    /**
     * the error code of the final response's body ("" for
     * none): JSON "code" (or "error.code"), or an RFC 9457 problem's "code" or
     * "type"
     */
    code: string;
    /**
     * the final response's body, parsed when it is JSON;
     * undefined while pending, and once dropped from the journal (keepResponses)
     */
    response: unknown;
    /**
     * the server answered from its record of the first
     * arrival (Idempotent-Replayed: true) rather than executing again
     */
    replayed: boolean;
    /**
     * why the intent needs attention, for a developer or a
     * log: the last failure of a pending intent, a refusal's reason (chosen by
     * code), why it expired; "" when none
     */
    error: string;
    /**
     * why the last attempt got no final answer
     */
    cause: FailureCause;
    /**
     * when this browser sends the pending intent again by
     * itself, milliseconds since the epoch; 0 when nothing will (offline: it goes
     * out when the browser is back online; or re-driving is off)
     */
    retryAt: number;
    /**
     * the key the intent was first sent with, when the
     * server refused that key for its age and it was sent again under this one; ""
     */
    previousKey: string;
    method: string;
    url: string;
    /**
     * when the intent was journaled, milliseconds since the epoch
     */
    createdAt: number;
};
/**
 * What happens to an intent, as it happens, for a page to show. Each client
 * also hears what the other tabs' clients of its journal and owner do, marked
 * otherTab.
 *
 * - journaled: the intent is on disk; nothing was sent yet.
 * - waiting: another tab (or call) is sending this intent; this one waits for it.
 * - sending: attempt number `attempt` goes out.
 * - failed: the attempt got no final answer (`error`, `cause`, `httpStatus` when
 *   there was a response). With `delay` (and `retryAt`) the next attempt follows
 *   that much later; without, a paused or exhausted event follows.
 * - paused: the round of attempts ended with the intent pending; the client
 *   sends it again by itself at `retryAt` (sooner when the browser comes back
 *   online, the page is shown again or gets focus, or on retry(key)).
 * - exhausted: the round ended with the intent pending, and nothing in this page
 *   sends it again by itself (re-driving is off, or the client was closed):
 *   resume() or retry(key) does.
 * - offline: the browser is offline; the intent stays pending and is sent when it
 *   is back online.
 * - rekeyed: the server refused the key for its age because this device's clock
 *   is wrong; the same intent goes out again under `key`, its first key
 *   `previousKey` never having taken effect.
 * - finished: a final response was recorded (`httpStatus`, `code`), by another
 *   tab when otherTab.
 * - expired: the intent is past the key lifetime and is not sent again.
 * - gone: the intent is no longer in the journal and is not sent again.
 * - forgotten: forget(key) or clear() deleted the intent.
 */
export type IntentEvent = {
    type: "journaled" | "waiting" | "sending" | "failed" | "paused" | "exhausted" | "offline" | "rekeyed" | "finished" | "expired" | "gone" | "forgotten";
    key: string;
    attempt?: number | undefined;
    httpStatus?: number | undefined;
    code?: string | undefined;
    /**
     * milliseconds until the next attempt
     */
    delay?: number | undefined;
    /**
     * when the next attempt goes out, milliseconds since the epoch
     */
    retryAt?: number | undefined;
    error?: string | undefined;
    cause?: import("./journal.js").FailureCause | undefined;
    previousKey?: string | undefined;
    /**
     * another tab's client did this
     */
    otherTab?: boolean | undefined;
};
export type ClientOptions = {
    /**
     * IndexedDB database of the intents (default "idem").
     * Clients of one origin that name the same journal share its intents, and
     * coordinate so that each intent is sent by one of them at a time.
     */
    journal?: string | undefined;
    /**
     * whose intents this client sends, lists and forgets:
     * the signed-in user (default: scope). Each intent is journaled under its
     * owner; a client never touches another owner's intents.
     */
    owner?: string | undefined;
    /**
     * what request paths are resolved against (default:
     * the page's origin). Another origin must follow the CORS contract in the
     * README.
     */
    baseURL?: string | undefined;
    /**
     * sent as Idempotency-Scope on new intents when not empty
     */
    scope?: string | undefined;
    /**
     * sends per round of submit(), resume() or
     * retry() (default 8); then the intent is paused, and sent again by the
     * client's re-drive
     */
    maxAttempts?: number | undefined;
    /**
     * milliseconds (default 100); see backoffMax
     */
    backoffBase?: number | undefined;
    /**
     * milliseconds (default 10000). Retry n of a
     * round waits a random time up to min(backoffMax, backoffBase·2^(n-1)), or at
     * least a server's Retry-After; a Retry-After longer than backoffMax pauses the
     * intent until then.
     */
    backoffMax?: number | undefined;
    /**
     * keep sending paused intents while the page is
     * open: one attempt at a time, redriveMax apart at most, and at once when the
     * browser comes back online, the page is shown again or gets focus (default
     * true)
     */
    redrive?: boolean | undefined;
    /**
     * milliseconds (default 30000): the wait between
     * the re-drive's attempts starts near backoffMax and doubles up to this
     */
    redriveMax?: number | undefined;
    /**
     * requests resume() and the re-drive have on
     * the wire at once (default 4, below the six connections a browser opens to
     * one host); submit() and retry() are sent at once
     */
    concurrency?: number | undefined;
    /**
     * milliseconds one attempt may take from the moment
     * it is sent, response body included (default 10000)
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
     * response, and an expired one after its key lifetime (default 7 days);
     * resume() prunes older ones
     */
    pruneAfter?: number | undefined;
    /**
     * keep a finished intent's body, headers and
     * response in the journal until it is pruned (default false: dropped when it
     * finishes; its key, status, HTTP status and code stay)
     */
    keepResponses?: boolean | undefined;
    /**
     * headers added to every attempt, asked afresh each time and never journaled:
     * an Authorization or a CSRF token
     */
    headers?: (() => Record<string, string> | Promise<Record<string, string>>) | undefined;
    /**
     * the fetch credentials mode
     * (default "same-origin"; "include" sends cookies to another origin)
     */
    credentials?: RequestCredentials | undefined;
    /**
     * decides
     * whether an answer leaves the outcome open (true: sent again with the key) or
     * is final (false); undefined falls back to the default (5xx, 408, 425, 429,
     * and 409 with the in-progress code or a Retry-After)
     */
    shouldRetry?: ((a: AnswerInfo) => boolean | undefined) | undefined;
    /**
     * sends the requests (default: the global fetch)
     */
    fetch?: typeof fetch | undefined;
    /**
     * told what happens to each intent
     */
    onEvent?: ((e: IntentEvent) => void) | undefined;
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
     * with a different body (422). It is journaled in IndexedDB, readable by any
     * script of the origin: never card numbers or other secrets (send a token).
     */
    body?: unknown;
    /**
     * the body's Content-Type (default
     * "application/json")
     */
    contentType?: string | undefined;
    /**
     * the request's own headers,
     * journaled with it and sent with every attempt: no secrets (see
     * ClientOptions.headers)
     */
    headers?: Record<string, string> | undefined;
};
/**
 * How the client comes to send an intent: "user" (submit, retry: always, at
 * once), "trigger" (resume and wake-ups: unless someone attempted it since
 * `at`), "due" (the re-drive's timer for `at`: unless it was rescheduled).
 */
export type Drive = {
    kind: "user";
} | {
    kind: "trigger";
    at: number;
} | {
    kind: "due";
    at: number;
};
/**
 * What one attempt got.
 */
export type Outcome = {
    kind: "error";
    cause: FailureCause;
    error: string;
} | {
    kind: "redirect";
    status: number;
    location: string;
} | {
    kind: "response";
    status: number;
    body: string;
    code: string;
    replayed: boolean;
    retryAfterMs: number;
    retryAfter: boolean;
    date: string | null;
};
