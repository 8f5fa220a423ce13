// The payment page: idem's browser client (served under /pay/idem/) behind a Pay
// button, and the switches that let a person see it hold: a response dropped or
// held between the server and the page, a reload or a closed tab mid-request, the
// network off, and the journal wiped (the negative control).

import { Client, IntentGoneError } from "/pay/idem/idem.js";

/** The IndexedDB journal of this page's intents, shared by its tabs. */
const journal = "idem-pay";

/** @param {string} id */
const $ = (id) => /** @type {HTMLElement} */ (document.getElementById(id));

/** The last thing this tab saw happen to each intent (an IntentEvent type). */
const lastEvent = new Map();
/** Ledger rows per key, as GET /pay/ledger last answered. */
const ledger = new Map();
/** Intents whose first response this page dropped. */
const dropped = new Set();
/** Tells the page's other tabs that the journal changed. */
const channel = new BroadcastChannel("idem-pay");

const client = new Client({ journal, fetch: pageFetch, onEvent });

function onEvent(e) {
  lastEvent.set(e.key, e.type);
  log(describe(e));
  channel.postMessage("changed");
  render();
}

function describe(e) {
  switch (e.type) {
    case "journaled":
      return `${e.key}: minted and journaled; nothing sent yet`;
    case "waiting":
      return `${e.key}: another tab is sending this intent; waiting for it instead of sending it again`;
    case "sending":
      return `${e.key}: attempt ${e.attempt} sent`;
    case "failed":
      return `${e.key}: attempt ${e.attempt} got no answer (${e.error})${e.delay !== undefined ? `; retrying with the same key in ${e.delay} ms` : ""}`;
    case "offline":
      return `${e.key}: the browser is offline; it is sent with its key when the network is back`;
    case "finished":
      return `${e.key}: HTTP ${e.httpStatus} after ${e.attempt} attempt(s), recorded in the journal`;
    case "expired":
      return `${e.key}: expired, not sent again (${e.error})`;
    case "gone":
      return `${e.key}: no longer in the journal; not sent again`;
    default:
      return `${e.key}: ${e.type}`;
  }
}

/** @param {string} text */
function log(text) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toISOString().slice(11, 23)} ${text}`;
  $("log").prepend(li);
}

/** @param {string} text */
function notice(text) {
  $("notice").textContent = text;
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
  const account = /** @type {HTMLInputElement} */ ($("account")).value.trim();
  const amount = Number(/** @type {HTMLInputElement} */ ($("amount")).value);
  notice("");
  try {
    // One press, one intent: the client mints the key here and journals it
    // before the request leaves.
    const r = await client.submit({ path: "/v1/payments", body: { account, amount_cents: amount } });
    if (r.status !== "done") {
      notice(`${r.key} is ${r.status}${r.error ? `: ${r.error}` : ""}`);
    }
  } catch (e) {
    if (e instanceof IntentGoneError) {
      const li = document.createElement("li");
      li.dataset.key = e.key;
      li.textContent = `${e.key}: lost from the journal mid-request; the server may have charged it, and nothing here can tell`;
      $("lost").append(li);
      notice(`Intent ${e.key} left the journal while it was being sent, so it is not sent again. ` +
        "The server may already have charged it: pressing Pay now mints a new key, which the server takes for a new payment.");
    } else {
      notice(`The intent could not be journaled, so nothing was sent: ${e instanceof Error ? e.message : e}`);
    }
  }
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
  channel.postMessage("changed");
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
  } catch (e) {
    notice(`Reading the journal failed: ${e instanceof Error ? e.message : e}`);
  } finally {
    drawing = false;
  }
}

async function draw() {
  const intents = (await client.list()).reverse().slice(0, 50);
  const rows = intents.map((r) => {
    const tr = document.createElement("tr");
    tr.className = "intent";
    const rowsForKey = ledger.get(r.key);
    Object.assign(tr.dataset, {
      key: r.key,
      status: r.status,
      attempts: String(r.attempts),
      httpStatus: String(r.httpStatus),
      replayed: String(r.replayed),
      event: lastEvent.get(r.key) ?? "",
      ledger: rowsForKey ? String(rowsForKey.length) : "",
    });
    const cells = [
      ["key", r.key],
      ["status", r.status],
      ["attempts", String(r.attempts)],
      ["http", r.httpStatus ? String(r.httpStatus) : ""],
      ["replayed", r.replayed ? "yes" : ""],
      ["event", lastEvent.get(r.key) ?? ""],
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
      const rows = await ledgerRows(`key=${encodeURIComponent(r.key)}`);
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

channel.onmessage = () => render();
render();
// What a page does on every load: send whatever a reload, a crash or a restored
// tab left pending, each intent with its own key.
client.resume().then((rs) => {
  if (rs.length > 0) {
    log(`resumed ${rs.length} pending intent(s) from the journal: ${rs.map((r) => `${r.key} ${r.status}`).join(", ")}`);
  }
  render();
}, (e) => notice(`Resuming the journal's intents failed: ${e instanceof Error ? e.message : e}`));
setInterval(() => {
  refreshLedger().catch(() => {});
}, 700);
document.body.dataset.ready = "true";
