export { IntentGoneError } from "./journal.js";
export { newKey } from "./key.js";
export type ClientOptions = import("./client.js").ClientOptions;
export type SubmitRequest = import("./client.js").SubmitRequest;
export type Result = import("./client.js").Result;
export type IntentStatus = import("./client.js").IntentStatus;
export type IntentEvent = import("./client.js").IntentEvent;
export { Client, defaults } from "./client.js";
