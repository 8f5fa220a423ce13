// idem's browser client: an idempotency key minted on the user's act, journaled in
// IndexedDB before the first send, and sent again with every retry, reload,
// crashed tab and restored session, and by the open page itself, until the
// server has answered.
//
//   import { Client } from "./idem.js";
//   const idem = new Client({ owner: user.id });     // after sign-in
//   idem.resume();                                   // on every page load
//   button.onclick = () => idem.submit({ path: "/v1/payments", body: { account: "acct_1", amount_cents: 1250 } });
//   signOut.onclick = () => idem.clear();            // at logout

export { Client, defaults } from "./client.js";
export { IntentGoneError, JournalUnavailableError } from "./journal.js";
export { keyAgeCodes } from "./answer.js";
export { newKey } from "./key.js";

/** @typedef {import("./client.js").ClientOptions} ClientOptions */
/** @typedef {import("./client.js").SubmitRequest} SubmitRequest */
/** @typedef {import("./client.js").Result} Result */
/** @typedef {import("./client.js").IntentStatus} IntentStatus */
/** @typedef {import("./client.js").IntentEvent} IntentEvent */
/** @typedef {import("./journal.js").FailureCause} FailureCause */
/** @typedef {import("./retry.js").AnswerInfo} AnswerInfo */
