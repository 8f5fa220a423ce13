// The journal keeps every intent in IndexedDB, which outlives a reload, a crashed
// tab and a closed browser, and which every tab of the origin shares.

/**
 * @typedef {"pending" | "done" | "rejected"} StoredStatus
 * What the journal records. "expired" is never stored: it is derived from
 * createdAt when an intent is listed or about to be sent.
 */

/**
 * One intent as the journal keeps it.
 *
 * @typedef {object} IntentRecord
 * @property {string} key the idempotency key, minted before the first send
 * @property {string} scope sent as Idempotency-Scope when not empty
 * @property {string} method
 * @property {string} url the absolute URL
 * @property {string} body byte for byte what every attempt sends
 * @property {number} createdAt when it was journaled, milliseconds since the epoch
 * @property {number} attempts sends started with this key, across tabs and reloads
 * @property {StoredStatus} status
 * @property {number} [httpStatus] the final response's status
 * @property {string} [response] the final response's body
 * @property {boolean} [replayed] the server answered from its record of the first arrival
 * @property {number} [finishedAt] when the final response was recorded
 */

const storeName = "intents";

/** The intent is not in the journal: the journal was wiped, or it never held it. */
export class IntentGoneError extends Error {
  /** @param {string} key */
  constructor(key) {
    super(`idem: intent ${key} is not in the journal (it was wiped or pruned): it is not sent again; ` +
      "a new submit mints a new key, which the server takes for a new intent");
    this.name = "IntentGoneError";
    /** The key of the intent that is gone. */
    this.key = key;
  }
}

/**
 * The IndexedDB journal of intents. Writes that a key depends on (a new intent, a
 * final response) commit with strict durability, flushed to disk before they
 * resolve. Another tab or the user may delete the database at any time (clearing
 * the site's data): the journal then closes its connection and opens a fresh one
 * on its next call.
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
      const req = indexedDB.open(this.#name, 1);
      req.onupgradeneeded = () => {
        const store = req.result.createObjectStore(storeName, { keyPath: "key" });
        store.createIndex("createdAt", "createdAt");
      };
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
      req.onblocked = () => reject(new Error(`idem: journal ${this.#name}: opening is blocked by another connection`));
    });
    this.#db = opening;
    opening.catch(() => {
      if (this.#db === opening) {
        this.#db = null;
      }
    });
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
      /** @type {IDBTransactionOptions} */
      const opts = { durability: strict ? "strict" : "default" };
      const tx = db.transaction(storeName, mode, opts);
      /** @type {T} */
      let value = /** @type {T} */ (/** @type {unknown} */ (undefined));
      let failure = /** @type {unknown} */ (null);
      tx.oncomplete = () => (failure ? reject(failure) : resolve(value));
      tx.onerror = () => reject(failure ?? tx.error);
      tx.onabort = () => reject(failure ?? tx.error ?? new Error("idem: journal transaction aborted"));
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
   * @returns {Promise<IntentRecord>}
   */
  recordAttempt(key) {
    return this.#update(key, (rec) => {
      if (rec.status !== "pending") {
        return null;
      }
      return { ...rec, attempts: rec.attempts + 1 };
    }, false);
  }

  /**
   * Records the final response. An intent already finished (by another tab) keeps
   * its first response, which is returned. It rejects with IntentGoneError for a
   * key the journal does not hold.
   *
   * @param {string} key
   * @param {{status: "done" | "rejected", httpStatus: number, response: string, replayed: boolean}} fin
   * @returns {Promise<IntentRecord>}
   */
  finish(key, fin) {
    return this.#update(key, (rec) => {
      if (rec.status !== "pending") {
        return null;
      }
      return { ...rec, ...fin, finishedAt: Date.now() };
    }, true);
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
   * Every intent, oldest first.
   *
   * @returns {Promise<IntentRecord[]>}
   */
  all() {
    return this.#tx("readonly", false, (store, set) => {
      const get = store.index("createdAt").getAll();
      get.onsuccess = () => set(get.result);
    });
  }

  /**
   * The intents without a final response, oldest first.
   *
   * @returns {Promise<IntentRecord[]>}
   */
  async pending() {
    return (await this.all()).filter((r) => r.status === "pending");
  }

  /**
   * Deletes finished intents whose response arrived before the given time. Pending
   * intents are never pruned: their key is still needed.
   *
   * @param {number} beforeMs milliseconds since the epoch
   * @returns {Promise<number>} how many were deleted
   */
  prune(beforeMs) {
    return this.#tx("readwrite", false, (store, set) => {
      let n = 0;
      const cur = store.openCursor();
      cur.onsuccess = () => {
        const c = cur.result;
        if (!c) {
          set(n);
          return;
        }
        /** @type {IntentRecord} */
        const rec = c.value;
        if (rec.status !== "pending" && (rec.finishedAt ?? 0) < beforeMs) {
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
