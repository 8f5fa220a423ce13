// Type-checked by tsconfig.usage.json, never run: the package's declarations as a
// TypeScript user meets them.
import {
  Client, IntentGoneError, JournalUnavailableError, defaults, keyAgeCodes, newKey,
  type AnswerInfo, type FailureCause, type IntentEvent, type Result,
} from "@idemkit/browser";

const events: IntentEvent[] = [];
const client = new Client({
  journal: "payments",
  owner: "user_42",
  maxAttempts: defaults.maxAttempts,
  redriveMax: defaults.redriveMax,
  concurrency: 2,
  headers: async () => ({ Authorization: "Bearer token" }),
  credentials: "include",
  shouldRetry: (a: AnswerInfo) => (a.status === 409 ? false : undefined),
  onEvent: (e) => events.push(e),
});

export async function pay(account: string, amountCents: number): Promise<string> {
  try {
    const r: Result = await client.submit({ path: "/v1/payments", body: { account, amount_cents: amountCents }, headers: { "X-Request-Source": "web" } });
    switch (r.status) {
      case "done":
        return `${r.key}: HTTP ${r.httpStatus} after ${r.attempts} attempts${r.replayed ? " (replayed)" : ""}`;
      case "pending": {
        const cause: FailureCause = r.cause;
        return `${r.key}: pending (${cause}), next try at ${new Date(r.retryAt).toISOString()}`;
      }
      case "rejected":
        return keyAgeCodes.includes(r.code) ? "check the clock" : `${r.key}: ${r.code}: ${r.error}`;
      case "expired":
        return `${r.key}: ${r.status}: ${r.error}`;
    }
  } catch (e) {
    if (e instanceof IntentGoneError) {
      return `intent ${e.key} left the journal (last HTTP ${e.httpStatus})`;
    }
    if (e instanceof JournalUnavailableError) {
      return `nothing was sent: ${e.reason}`;
    }
    throw e;
  }
}

export async function overview(): Promise<number> {
  const resumed: Result[] = await client.resume();
  const all = await client.list();
  const one = await client.status(newKey());
  const again: Result | undefined = await client.retry(newKey());
  const forgot: boolean = await client.forget(newKey());
  const cleared: number = await client.clear();
  const pruned: number = await client.prune(60_000);
  const kept: boolean = await client.persist();
  const together: boolean = client.coordinated;
  client.close();
  return resumed.length + all.length + (one ? 1 : 0) + (again ? 1 : 0) + Number(forgot) + cleared + pruned + Number(kept) + Number(together) + events.length + client.owner.length;
}
