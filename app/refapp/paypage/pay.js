// The payment page: idem's browser client (served under /pay/idem/) behind a Pay
// button, for a signed-in user, and the switches that let a person see it hold: a
// response dropped or held between the server and the page, a reload or a closed
// tab mid-request, the network off, the service down, and the journal wiped (the
// negative control).

import { Client, IntentGoneError, JournalUnavailableError, keyAgeCodes } from "/pay/idem/idem.js";

/** The IndexedDB journal of this page's intents, shared by its tabs and users. */
const journal = "idem-pay";
/** Where the page remembers who is signed in, as a session cookie would. */
const sessionKey = "idem-pay-user";
/** What a user name may be: it is sent as Idempotency-Scope. */
const userName = /^[A-Za-z0-9_.-]{1,64}$/;

/** @param {string} id */
const $ = (id) => /** @type {HTMLElement} */ (document.getElementById(id));

/** The last thing this tab saw happen to each intent (an IntentEvent type). */
const lastEvent = new Map();
/** Ledger rows per key, as GET /pay/ledger last answered. */
const ledger = new Map();
/** Intents whose first response this page dropped. */
const dropped = new Set();
/** The intent this tab's notice is about: its latest press, or one it resumed. */
let current = "";
/** A press is being journaled: its journaled event names the new current intent. */
let pressing = false;

let user = readSession();
let client = connect(user);

/** @returns {string} */
function readSession() {
  try {
    const u = localStorage.getItem(sessionKey) ?? "";
    return userName.test(u) ? u : "";
  } catch {
    return "";
  }
}

/** @param {string} u */
function writeSession(u) {
  try {
    if (u) {
      localStorage.setItem(sessionKey, u);
    } else {
      localStorage.removeItem(sessionKey);
    }
  } catch {
    // Storage blocked: the session lasts as long as the tab.
  }
}

/**
 * A client for one user: it sends, lists and forgets only that user's intents,
 * and on connecting sends what a reload, a crash or a restored tab left pending.
 *
 * @param {string} u "" for nobody signed in
 */
function connect(u) {
  const c = new Client({ journal, scope: u, owner: u, fetch: pageFetch, onEvent });
  $("who").textContent = u || "nobody (payments are anonymous)";
  document.body.dataset.user = u;
  $("sign-out").hidden = u === "";
  $("coordination").textContent = c.coordinated ? "" :
    "This page is not a secure context, so its tabs cannot coordinate (no Web Locks): two tabs may send one payment at once, which the server still charges once.";
  c.resume().then((rs) => {
    if (rs.length > 0) {
      log(`resumed ${rs.length} pending intent(s) of ${u || "the anonymous user"} from the journal: ${rs.map((r) => `${r.key} ${r.status}`).join(", ")}`);
      current ||= rs.at(-1)?.key ?? "";
      showCurrent();
    }
    render();
  }, (e) => journalStatus(`Resuming the journal's intents failed: ${reason(e)}`));
  return c;
}

/** @param {import("/pay/idem/idem.js").IntentEvent} e */
function onEvent(e) {
  lastEvent.set(e.key, e.type);
  if (e.type === "journaled" && pressing && !e.otherTab) {
    current = e.key;
    pressing = false;
  }
  if (e.type === "rekeyed" && e.previousKey === current) {
    current = e.key;
  }
  log(`${e.otherTab ? "(another tab) " : ""}${describe(e)}`);
  if (e.key === current) {
    showCurrent();
  }
  render();
}

/** @param {import("/pay/idem/idem.js").IntentEvent} e */
function describe(e) {
  switch (e.type) {
    case "journaled":
      return `${e.key}: minted and journaled; nothing sent yet`;
    case "waiting":
      return `${e.key}: another tab is sending this intent; waiting for it instead of sending it again`;
    case "sending":
      return `${e.key}: attempt ${e.attempt} sent`;
    case "failed":
      return `${e.key}: attempt ${e.attempt} got no answer (${e.cause}: ${e.error})${e.delay !== undefined ? `; the next attempt follows in ${e.delay} ms` : ""}`;
    case "paused":
      return `${e.key}: paused; sent again with the same key at ${clock(e.retryAt ?? 0)}, or sooner when the page is shown again or the network is back`;
    case "exhausted":
      return `${e.key}: not sent again by this page`;
    case "offline":
      return `${e.key}: the browser is offline; it is sent with its key when the network is back`;
    case "rekeyed":
      return `${e.key}: ${e.error}`;
    case "finished":
      return `${e.key}: HTTP ${e.httpStatus}${e.code ? ` ${e.code}` : ""} after ${e.attempt} attempt(s), recorded in the journal`;
    case "expired":
      return `${e.key}: expired, not sent again (${e.error})`;
    case "gone":
      return `${e.key}: no longer in the journal; not sent again`;
    case "forgotten":
      return `${e.key}: forgotten: deleted from this browser's journal`;
    default:
      return `${e.key}: ${e.type}`;
  }
}

/**
 * What the user reads about a payment, in their words, chosen by its status,
 * the cause of its last failure and the server's error code.
 *
 * @param {import("/pay/idem/idem.js").Result} r
 * @returns {string}
 */
function words(r) {
  const next = r.retryAt ? ` Next try at ${clock(r.retryAt)}.` : "";
  const dontPayAgain = " You don't need to press Pay again.";
  switch (r.status) {
    case "done":
      return r.replayed ? "Payment accepted. (The service had already recorded it: it was charged once.)" : "Payment accepted.";
    case "expired":
      return "We could not confirm this payment within a day, so this browser will not send it again. " +
        "Please check your statement before paying again.";
    case "rejected":
      if (keyAgeCodes.includes(r.code)) {
        return "The payment service refused this payment because your device's clock seems to be wrong. Nothing was charged. " +
          "Set your clock right, then pay again.";
      }
      if (r.code === "idempotency_key_mismatch") {
        return "This payment clashed with an earlier one and was not made.";
      }
      return `The payment was refused (${r.code || `error ${r.httpStatus}`}). Nothing was charged.`;
    case "pending":
      switch (r.cause) {
        case "offline":
          return `You are offline. Your payment is saved in this browser and goes out when you are back online.${dontPayAgain}`;
        case "cors":
          return "The payment service answered, but its set-up keeps this page from reading the answer, so the payment may have gone through. " +
            `It is saved here and checked again automatically.${next}${dontPayAgain}`;
        case "timeout":
          return `The payment service is slow to answer. Your payment is saved in this browser and is sent again automatically.${next}${dontPayAgain}`;
        case "http":
          return `The payment service is having trouble. Your payment is saved in this browser and is sent again automatically.${next}${dontPayAgain}`;
        case "redirect":
          return `The payment service's address is misconfigured. Your payment is saved in this browser and is tried again automatically.${next}${dontPayAgain}`;
        default:
          return r.attempts === 0 ? "Sending your payment..." :
            `We can't reach the payment service right now. Your payment is saved in this browser and is sent automatically.${next}${dontPayAgain}`;
      }
  }
}

/** Shows the state of this tab's current intent. */
async function showCurrent() {
  const key = current;
  if (!key) {
    return;
  }
  let r;
  try {
    r = await client.status(key);
  } catch {
    return;
  }
  if (key !== current || !r) {
    return;
  }
  notice(words(r), r);
}

/** @param {number} ms */
function clock(ms) {
  return new Date(ms).toLocaleTimeString();
}

/** @param {unknown} e */
function reason(e) {
  if (e instanceof JournalUnavailableError) {
    return e.reason;
  }
  return e instanceof Error ? e.message || e.name : String(e);
}

/** @param {string} text */
function log(text) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toISOString().slice(11, 23)} ${text}`;
  $("log").prepend(li);
}

/**
 * The notice about the user's payment: it stays until the next thing to say
 * about a payment.
 *
 * @param {string} text
 * @param {import("/pay/idem/idem.js").Result} [r] the intent it is about
 */
function notice(text, r) {
  const el = $("notice");
  el.replaceChildren(text);
  el.dataset.key = r?.key ?? "";
  el.dataset.status = r?.status ?? "";
  el.dataset.cause = r?.cause ?? "";
  el.dataset.code = r?.code ?? "";
  if (r?.status === "pending" && r.cause !== "offline") {
    const b = document.createElement("button");
    b.type = "button";
    b.id = "retry-now";
    b.textContent = "Try again now";
    b.addEventListener("click", () => {
      client.retry(r.key).then(() => showCurrent(), (e) => journalStatus(`Sending it again failed: ${reason(e)}`));
    });
    el.append(" ", b);
  }
}

/** A problem with this browser's storage, apart from any payment's notice. */
/** @param {string} text */
function journalStatus(text) {
  $("journal-status").textContent = text;
}

function netMode() {
  return /** @type {HTMLInputElement} */ (document.querySelector("input[name=net]:checked")).value;
}

/**
 * The network as the switches say: the request always reaches the server, which
 * answers in full; the page may then lose the answer (drop) or keep it back until
 * a person decides (hold).
 *
 * @param {RequestInfo | URL} url
 * @param {RequestInit} [init]
 */
async function pageFetch(url, init) {
  const res = await fetch(url, init);
  if (res.type === "opaqueredirect") {
    return res;
  }
  const body = await res.text();
  const key = new Headers(init?.headers).get("Idempotency-Key") ?? "";
  const mode = netMode();
  if (mode === "drop" && !dropped.has(key)) {
    dropped.add(key);
    log(`${key}: the server answered HTTP ${res.status}; the page dropped that response, as a lost connection would`);
    throw new TypeError(`the response (HTTP ${res.status}) was dropped by the page's switch`);
  }
  if (mode === "hold" && (await hold(key, res.status)) === "drop") {
    log(`${key}: the held response (HTTP ${res.status}) was dropped`);
    throw new TypeError(`the held response (HTTP ${res.status}) was dropped`);
  }
  return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
}

/**
 * Keeps a response back until a person delivers or drops it.
 *
 * @param {string} key
 * @param {number} status
 * @returns {Promise<"deliver" | "drop">}
 */
function hold(key, status) {
  log(`${key}: the server answered HTTP ${status}; the page holds the response`);
  return new Promise((resolve) => {
    const li = document.createElement("li");
    li.dataset.key = key;
    li.dataset.httpStatus = String(status);
    li.append(`The server answered HTTP ${status} to ${key}; the page has not seen it yet.`);
    for (const verdict of /** @type {const} */ (["deliver", "drop"])) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = verdict;
      b.textContent = verdict === "deliver" ? "Deliver" : "Drop";
      b.addEventListener("click", () => {
        li.remove();
        resolve(verdict);
      });
      li.append(b);
    }
    $("held").append(li);
  });
}

$("pay-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const pay = /** @type {HTMLButtonElement} */ ($("pay"));
  if (pay.disabled) {
    return;
  }
  // Off at once, before the journal is written: a double click is one press.
  pay.disabled = true;
  const account = /** @type {HTMLInputElement} */ ($("account")).value.trim();
  const amount = Number(/** @type {HTMLInputElement} */ ($("amount")).value);
  notice("Sending your payment...");
  current = "";
  pressing = true;
  client.persist().then((kept) => {
    $("storage").textContent = kept ? "This browser keeps the journal (persistent storage)." :
      "The journal is best-effort here: the browser may clear it when storage runs short.";
  });
  try {
    // One press, one intent: the client mints the key here and journals it
    // before the request leaves.
    const r = await client.submit({ path: "/v1/payments", body: { account, amount_cents: amount } });
    if (r.key === current) {
      notice(words(r), r);
    }
  } catch (e) {
    pressing = false;
    if (e instanceof IntentGoneError) {
      const li = document.createElement("li");
      li.dataset.key = e.key;
      li.textContent = `${e.key}: lost from the journal mid-request; the server may have charged it, and nothing here can tell`;
      $("lost").append(li);
      notice("This payment was deleted from this browser while it was being sent, so it is not sent again. " +
        "It may already have been charged: check your statement before paying again.");
    } else {
      notice(`Your payment could not be saved in this browser, so nothing was sent or charged: ${reason(e)}`);
    }
  }
  render();
});

$("session").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const u = /** @type {HTMLInputElement} */ ($("user")).value.trim();
  if (!userName.test(u)) {
    journalStatus("A user name is 1 to 64 letters, digits, dots, dashes or underscores.");
    return;
  }
  // Another user on this browser: the last one's intents stay theirs, unsent.
  client.close();
  user = u;
  writeSession(u);
  current = "";
  notice("");
  client = connect(u);
  render();
});

$("sign-out").addEventListener("click", async () => {
  let forgotten = 0;
  try {
    const pending = (await client.list()).filter((r) => r.status === "pending").length;
    // Forget this user's journal: nothing of theirs is sent under the next session.
    await client.clear();
    forgotten = pending;
  } catch (e) {
    journalStatus(`Forgetting the journal failed: ${reason(e)}`);
  }
  client.close();
  user = "";
  writeSession("");
  current = "";
  client = connect("");
  notice(forgotten ? `Signed out. ${forgotten} payment(s) still being sent were forgotten by this browser; they may or may not have been charged.` : "Signed out.");
  render();
});

$("wipe").addEventListener("click", async () => {
  await new Promise((resolve, reject) => {
    const req = indexedDB.deleteDatabase(journal);
    req.onsuccess = resolve;
    req.onerror = () => reject(req.error);
    req.onblocked = () => log("waiting for the page's other tabs to let go of the journal");
  });
  log("the journal was wiped: every key in it is forgotten");
  render();
});

/** Redraws the table from the journal; calls during a redraw fold into one more. */
let drawing = false;
let redraw = false;
async function render() {
  if (drawing) {
    redraw = true;
    return;
  }
  drawing = true;
  try {
    do {
      redraw = false;
      await draw();
    } while (redraw);
    journalStatus("");
  } catch (e) {
    journalStatus(`Reading this browser's journal failed: ${reason(e)}`);
  } finally {
    drawing = false;
  }
}

async function draw() {
  const all = await client.list();
  // Pay waits while a payment of this user is on its way: a second press is a
  // second payment, made once the first is settled.
  const waiting = all.some((r) => r.status === "pending");
  const pay = /** @type {HTMLButtonElement} */ ($("pay"));
  pay.disabled = waiting;
  $("pay-state").textContent = waiting ? "A payment of yours is still being sent: Pay is off until it is settled." : "";
  const intents = all.reverse().slice(0, 50);
  const rows = intents.map((r) => {
    const tr = document.createElement("tr");
    tr.className = "intent";
    const rowsForKey = ledger.get(r.key);
    Object.assign(tr.dataset, {
      key: r.key,
      previousKey: r.previousKey,
      status: r.status,
      attempts: String(r.attempts),
      httpStatus: String(r.httpStatus),
      code: r.code,
      cause: r.cause,
      retryAt: String(r.retryAt),
      replayed: String(r.replayed),
      event: lastEvent.get(r.key) ?? "",
      ledger: rowsForKey ? String(rowsForKey.length) : "",
    });
    const cells = [
      ["key", r.key],
      ["status", r.status],
      ["attempts", String(r.attempts)],
      ["http", r.httpStatus ? `${r.httpStatus}${r.code ? ` ${r.code}` : ""}` : ""],
      ["replayed", r.replayed ? "yes" : ""],
      ["event", `${lastEvent.get(r.key) ?? ""}${r.retryAt ? ` (next ${clock(r.retryAt)})` : ""}`],
      ["ledger", rowsForKey ? `${rowsForKey.length} row(s)${rowsForKey.length ? `: ${rowsForKey.map((x) => `#${x.id} ${x.account} ${x.amount_cents}`).join(", ")}` : ""}` : ""],
    ];
    for (const [cls, text] of cells) {
      const td = document.createElement("td");
      td.className = cls;
      td.textContent = text;
      tr.append(td);
    }
    if (rowsForKey && rowsForKey.length > 1) {
      tr.lastElementChild?.classList.add("double");
    }
    return tr;
  });
  /** @type {HTMLElement} */ ($("intents").querySelector("tbody")).replaceChildren(...rows);
}

/** Reads the ledger rows of recent done intents that have none yet, and of the account. */
async function refreshLedger() {
  const recent = Date.now() - 10 * 60 * 1000;
  for (const r of await client.list()) {
    if (r.status === "done" && r.createdAt > recent && !(ledger.get(r.key)?.length)) {
      const rows = await ledgerRows(`key=${encodeURIComponent(r.key)}&scope=${encodeURIComponent(user)}`);
      if (rows) {
        ledger.set(r.key, rows);
      }
    }
  }
  const account = /** @type {HTMLInputElement} */ ($("account")).value.trim();
  if (account) {
    const rows = await ledgerRows(`account=${encodeURIComponent(account)}`);
    if (rows) {
      const p = $("account-ledger");
      p.dataset.account = account;
      p.dataset.rows = String(rows.length);
      const keys = new Set(rows.map((x) => x.key));
      p.textContent = `ledger_entries for ${account}: ${rows.length} row(s) under ${keys.size} key(s)`;
    }
  }
  render();
}

/** @param {string} query */
async function ledgerRows(query) {
  try {
    const res = await fetch(`/pay/ledger?${query}`, { cache: "no-store" });
    return res.ok ? (await res.json()).rows : null;
  } catch {
    return null;
  }
}

render();
setInterval(() => {
  refreshLedger().catch(() => {});
}, 700);
document.body.dataset.ready = "true";
