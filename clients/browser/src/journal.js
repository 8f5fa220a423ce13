// The journal keeps every intent in IndexedDB, which outlives a reload, a crashed
// tab and a closed browser, and which every tab of the origin shares. Each
// record names its owner (the signed-in user), and every read and deletion a
// client makes names the owner it serves.

/**
 * @typedef {"pending" | "done" | "rejected"} StoredStatus
 * What the journal records. "expired" is never stored: it is derived from
 * createdAt when an intent is listed or about to be sent.
 */

/**
 * Why the last attempt got no final answer: "network" (no answer: the service
 * is unreachable or the connection broke), "cors" (the service answered, but the
 * browser hid the answer from the page: its CORS configuration), "timeout",
 * "http" (a 5xx, 408, 409 in progress, 425 or 429), "redirect" (not followed),
 * "offline" (not sent: the browser is offline), "clock" (refused for the key's
 * age: this device's clock), or "" (none yet).
 *
 * @typedef {"" | "network" | "cors" | "timeout" | "http" | "redirect" | "offline" | "clock"} FailureCause
 */

/**
 * One intent as the journal keeps it. A finished intent keeps its key, status,
 * HTTP status and error code; its body, headers and response are dropped when
 * it finishes, unless the client keeps responses.
 *
 * @typedef {object} IntentRecord
 * @property {string} key the idempotency key, minted before the first send
 * @property {string} owner whose intent it is: only a client of this owner sends,
 *   lists or forgets it
 * @property {string} scope sent as Idempotency-Scope when not empty
 * @property {string} method
 * @property {string} url the absolute URL
 * @property {string} [body] byte for byte what every attempt sends
 * @property {string} [contentType] the body's Content-Type
 * @property {Record<string, string>} [headers] the request's own headers, sent
 *   with every attempt
 * @property {number} createdAt when it was journaled, milliseconds since the epoch
 * @property {number} attempts sends started with this key, across tabs and reloads
 * @property {StoredStatus} status
 * @property {number} [lastAttemptAt] when the latest attempt started
 * @property {number} [retryAt] when a client sends the pending intent again by
 *   itself; 0 when none will (offline, or no client re-drives it)
 * @property {number} [pauses] how often its rounds of attempts ended with it pending
 * @property {FailureCause} [cause] why the last attempt got no final answer
 * @property {string} [lastError] what the last attempt got, or why it was refused
 * @property {string} [previousKey] the key it was first sent with, when it was
 *   sent again under a new key because the server refused the first for its age
 * @property {number} [httpStatus] the final response's status
 * @property {string} [code] the final response's error code
 * @property {string} [response] the final response's body, when kept
 * @property {boolean} [replayed] the server answered from its record of the first arrival
 * @property {number} [finishedAt] when the final response was recorded
 */

const storeName = "intents";
const schemaVersion = 2;

/** The intent is not in the journal: the journal was wiped, or it never held it. */
export class IntentGoneError extends Error {
  /** @param {string} key */
  constructor(key) {
    super(`idem: intent ${key} is not in the journal (it was wiped, forgotten or pruned): it is not sent again; ` +
      "a new submit mints a new key, which the server takes for a new intent");
    this.name = "IntentGoneError";
    /** The key of the intent that is gone. */
    this.key = key;
    /** The status of the last answer the intent got before it left the journal; 0 for none. */
    this.httpStatus = 0;
    /** That answer's body, parsed when it is JSON; undefined for none. */
    /** @type {unknown} */
    this.response = undefined;
  }
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
  constructor(journal, cause) {
    const reason = storageFailure(cause);
    super(`idem: the journal (IndexedDB "${journal}") cannot be used: ${reason}`, { cause });
    this.name = "JournalUnavailableError";
    /** Why, in words. */
    this.reason = reason;
    /** The IndexedDB database name. */
    this.journal = journal;
  }
}

/**
 * What a storage failure means, by the DOMException's name.
 *
 * @param {unknown} e
 * @returns {string}
 */
function storageFailure(e) {
  const name = e instanceof Error || (e && typeof e === "object" && "name" in e) ? String(/** @type {{name: unknown}} */ (e).name) : "";
  const message = e instanceof Error ? e.message : e === undefined ? "" : String(e);
  switch (name) {
    case "QuotaExceededError":
      return "the browser's storage for this site is full (QuotaExceededError)";
    case "SecurityError":
      return "the browser does not allow storage here (SecurityError: storage blocked for this site, or an opaque origin)";
    case "InvalidStateError":
      return "IndexedDB is not usable in this context (InvalidStateError)";
    case "UnknownError":
      return "the browser's storage failed (UnknownError: the disk may be full, or the profile damaged)";
    case "VersionError":
      return "the journal was written by a newer version of this client (VersionError)";
    default:
      return message || name || "IndexedDB failed without saying why";
  }
}

/**
 * The IndexedDB journal of intents. Writes that a key depends on (a new intent, a
 * final response) ask for strict durability: the browser flushes them to disk
 * before they resolve, where it honours the hint. Another tab or the user may
 * delete the database at any time (clearing the site's data): the journal then
 * closes its connection and opens a fresh one on its next call.
 */
export class Journal {
  /** @type {string} */
  #name;
  /** @type {Promise<IDBDatabase> | null} */
  #db = null;

  /** @param {string} name the IndexedDB database name */
  constructor(name) {
    this.#name = name;
  }

  /** The IndexedDB database name. */
  get name() {
    return this.#name;
  }

  /** @returns {Promise<IDBDatabase>} */
  #open() {
    if (this.#db) {
      return this.#db;
    }
    const opening = new Promise((resolve, reject) => {
      if (typeof indexedDB === "undefined") {
        throw new Error("IndexedDB is not available in this context");
      }
      const req = indexedDB.open(this.#name, schemaVersion);
      req.onupgradeneeded = (ev) => upgrade(req, ev.oldVersion);
      req.onsuccess = () => {
        const db = req.result;
        // A deletion (or a newer schema) elsewhere waits for this connection: let it
        // go, and open again on the next call.
        const letGo = () => {
          db.close();
          if (this.#db === opening) {
            this.#db = null;
          }
        };
        db.onversionchange = letGo;
        db.onclose = letGo;
        resolve(db);
      };
      req.onerror = () => reject(req.error);
      req.onblocked = () => reject(new Error("opening is blocked by another connection to it"));
    }).catch((e) => {
      if (this.#db === opening) {
        this.#db = null;
      }
      throw new JournalUnavailableError(this.#name, e);
    });
    this.#db = opening;
    return opening;
  }

  /**
   * Runs fn in one transaction and resolves with its value once the transaction
   * has committed (with strict durability when asked).
   *
   * @template T
   * @param {IDBTransactionMode} mode
   * @param {boolean} strict
   * @param {(store: IDBObjectStore, set: (v: T) => void) => void} fn
   * @returns {Promise<T>}
   */
  async #tx(mode, strict, fn) {
    const db = await this.#open();
    return new Promise((resolve, reject) => {
      /** @type {T} */
      let value = /** @type {T} */ (/** @type {unknown} */ (undefined));
      let failure = /** @type {unknown} */ (null);
      /** @param {unknown} e */
      const fail = (e) => reject(e instanceof IntentGoneError ? e : new JournalUnavailableError(this.#name, e));
      /** @type {IDBTransaction} */
      let tx;
      try {
        tx = db.transaction(storeName, mode, { durability: strict ? "strict" : "default" });
      } catch (e) {
        fail(e);
        return;
      }
      tx.oncomplete = () => (failure ? fail(failure) : resolve(value));
      tx.onerror = () => fail(failure ?? tx.error);
      tx.onabort = () => fail(failure ?? tx.error ?? new Error("the journal's transaction was aborted"));
      try {
        fn(tx.objectStore(storeName), (v) => {
          value = v;
        });
      } catch (e) {
        failure = e;
        tx.abort();
      }
    });
  }

  /**
   * Records a new pending intent. It resolves only once the record is on disk: the
   * key may go on the wire right after. It fails for a key the journal holds.
   *
   * @param {IntentRecord} rec
   * @returns {Promise<void>}
   */
  append(rec) {
    return this.#tx("readwrite", true, (store) => {
      store.add(rec);
    });
  }

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
  recordAttempt(key, at) {
    return this.#update(key, (rec) => {
      if (rec.status !== "pending") {
        return null;
      }
      return { ...rec, attempts: rec.attempts + 1, lastAttemptAt: at };
    }, false);
  }

  /**
   * Records when a pending intent is sent next and why its last attempt failed.
   * A finished intent is returned unchanged. It rejects with IntentGoneError for
   * a key the journal does not hold.
   *
   * @param {string} key
   * @param {{retryAt: number, pauses: number, cause: FailureCause, lastError: string}} next
   * @returns {Promise<IntentRecord>}
   */
  schedule(key, next) {
    return this.#update(key, (rec) => (rec.status === "pending" ? { ...rec, ...next } : null), false);
  }

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
  async finish(key, fin, keep) {
    let first = false;
    const rec = await this.#update(key, (cur) => {
      if (cur.status !== "pending") {
        return null;
      }
      first = true;
      const { body, headers, response: _, retryAt: __, ...rest } = cur;
      /** @type {IntentRecord} */
      const next = { ...rest, ...fin, finishedAt: Date.now() };
      if (keep) {
        Object.assign(next, { body, headers });
      } else {
        delete next.response;
      }
      return next;
    }, true);
    return { rec, first };
  }

  /**
   * Replaces a pending intent by the same intent under a new key, in one
   * transaction. It rejects with IntentGoneError when the old key is gone or
   * finished.
   *
   * @param {string} oldKey
   * @param {IntentRecord} next
   * @returns {Promise<void>}
   */
  rekey(oldKey, next) {
    return this.#tx("readwrite", true, (store) => {
      const get = store.get(oldKey);
      get.onsuccess = () => {
        /** @type {IntentRecord | undefined} */
        const cur = get.result;
        if (!cur || cur.status !== "pending") {
          throw new IntentGoneError(oldKey);
        }
        store.delete(oldKey);
        store.add(next);
      };
    });
  }

  /**
   * @param {string} key
   * @param {(rec: IntentRecord) => IntentRecord | null} change null leaves the record as it is
   * @param {boolean} strict
   * @returns {Promise<IntentRecord>}
   */
  async #update(key, change, strict) {
    /** @type {IntentRecord | undefined} */
    const rec = await this.#tx("readwrite", strict, (store, set) => {
      const get = store.get(key);
      get.onsuccess = () => {
        /** @type {IntentRecord | undefined} */
        const cur = get.result;
        const next = cur && change(cur);
        if (next) {
          store.put(next);
        }
        set(next ?? cur);
      };
    });
    if (!rec) {
      throw new IntentGoneError(key);
    }
    return rec;
  }

  /**
   * @param {string} key
   * @returns {Promise<IntentRecord | undefined>}
   */
  get(key) {
    return this.#tx("readonly", false, (store, set) => {
      const get = store.get(key);
      get.onsuccess = () => set(get.result);
    });
  }

  /**
   * The intents of one owner, oldest first.
   *
   * @param {string} owner
   * @returns {Promise<IntentRecord[]>}
   */
  all(owner) {
    return this.#tx("readonly", false, (store, set) => {
      const get = store.index("owner").getAll(ownerRange(owner));
      get.onsuccess = () => set(get.result);
    });
  }

  /**
   * The intents of one owner without a final response, oldest first.
   *
   * @param {string} owner
   * @returns {Promise<IntentRecord[]>}
   */
  async pending(owner) {
    return (await this.all(owner)).filter((r) => r.status === "pending");
  }

  /**
   * Deletes one intent of an owner.
   *
   * @param {string} key
   * @param {string} owner
   * @returns {Promise<boolean>} whether it was there
   */
  forget(key, owner) {
    return this.#tx("readwrite", true, (store, set) => {
      set(false);
      const get = store.get(key);
      get.onsuccess = () => {
        /** @type {IntentRecord | undefined} */
        const cur = get.result;
        if (cur && cur.owner === owner) {
          store.delete(key);
          set(true);
        }
      };
    });
  }

  /**
   * Deletes every intent of an owner.
   *
   * @param {string} owner
   * @returns {Promise<string[]>} their keys
   */
  clear(owner) {
    return this.#tx("readwrite", true, (store, set) => {
      /** @type {string[]} */
      const keys = [];
      set(keys);
      const cur = store.index("owner").openCursor(ownerRange(owner));
      cur.onsuccess = () => {
        const c = cur.result;
        if (c) {
          keys.push(/** @type {IntentRecord} */ (c.value).key);
          c.delete();
          c.continue();
        }
      };
    });
  }

  /**
   * Deletes, whoever owns them, finished intents whose response arrived before
   * finishedBefore, and pending ones whose age (either way, for a clock set
   * back) is past staleAfter: they are past their key lifetime, never sent
   * again, and kept only that long for someone to reconcile them.
   *
   * @param {{finishedBefore: number, now: number, staleAfter: number}} bounds milliseconds
   * @returns {Promise<number>} how many were deleted
   */
  prune(bounds) {
    return this.#tx("readwrite", false, (store, set) => {
      let n = 0;
      set(0);
      const cur = store.openCursor();
      cur.onsuccess = () => {
        const c = cur.result;
        if (!c) {
          set(n);
          return;
        }
        /** @type {IntentRecord} */
        const rec = c.value;
        const stale = rec.status === "pending"
          ? Math.abs(bounds.now - rec.createdAt) > bounds.staleAfter
          : (rec.finishedAt ?? 0) < bounds.finishedBefore;
        if (stale) {
          c.delete();
          n++;
        }
        c.continue();
      };
    });
  }

  /** Closes the connection; the next call opens it again. */
  close() {
    const db = this.#db;
    this.#db = null;
    db?.then((d) => d.close(), () => {});
  }
}

/**
 * Creates the store (version 1) and the owner index (version 2); a record
 * journaled before owners existed belongs to its scope.
 *
 * @param {IDBOpenDBRequest} req
 * @param {number} oldVersion
 */
function upgrade(req, oldVersion) {
  const db = req.result;
  const tx = /** @type {IDBTransaction} */ (req.transaction);
  const store = oldVersion < 1 ? db.createObjectStore(storeName, { keyPath: "key" }) : tx.objectStore(storeName);
  if (oldVersion < 1) {
    store.createIndex("createdAt", "createdAt");
  }
  if (oldVersion < 2) {
    store.createIndex("owner", ["owner", "createdAt"]);
    if (oldVersion >= 1) {
      const cur = store.openCursor();
      cur.onsuccess = () => {
        const c = cur.result;
        if (!c) {
          return;
        }
        /** @type {IntentRecord} */
        const rec = c.value;
        if (typeof rec.owner !== "string") {
          c.update({ ...rec, owner: rec.scope ?? "" });
        }
        c.continue();
      };
    }
  }
}

/**
 * @param {string} owner
 * @returns {IDBKeyRange}
 */
function ownerRange(owner) {
  return IDBKeyRange.bound([owner, -Infinity], [owner, Infinity]);
}
