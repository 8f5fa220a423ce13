// Type-checked by tsconfig.usage.json, never run: the package's declarations as a
// TypeScript user meets them.
import { Client, IntentGoneError, defaults, newKey, type IntentEvent, type Result } from "@idemkit/browser";

const events: IntentEvent[] = [];
const client = new Client({ journal: "payments", maxAttempts: defaults.maxAttempts, onEvent: (e) => events.push(e) });

export async function pay(account: string, amountCents: number): Promise<string> {
  try {
    const r: Result = await client.submit({ path: "/v1/payments", body: { account, amount_cents: amountCents } });
    switch (r.status) {
      case "done":
        return `${r.key}: HTTP ${r.httpStatus} after ${r.attempts} attempts${r.replayed ? " (replayed)" : ""}`;
      case "pending":
      case "rejected":
      case "expired":
        return `${r.key}: ${r.status}: ${r.error}`;
    }
  } catch (e) {
    if (e instanceof IntentGoneError) {
      return `intent ${e.key} left the journal`;
    }
    throw e;
  }
}

export async function overview(): Promise<number> {
  const resumed: Result[] = await client.resume();
  const all = await client.list();
  const one = await client.status(newKey());
  const pruned: number = await client.prune(60_000);
  client.close();
  return resumed.length + all.length + (one ? 1 : 0) + pruned + events.length;
}
