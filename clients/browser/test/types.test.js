// The package type-checks (its JSDoc types, strictly), its declarations under
// types/ are the ones the sources give, and a TypeScript user's program compiles
// against them.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const tsc = join(root, "node_modules", "typescript", "bin", "tsc");

/** @param {string[]} args */
function run(args) {
  try {
    execFileSync(process.execPath, [tsc, ...args], { cwd: root, encoding: "utf8", stdio: "pipe" });
  } catch (e) {
    assert.fail(`tsc ${args.join(" ")}:\n${e.stdout}${e.stderr}`);
  }
}

test("the sources type-check and types/ is what they declare", () => {
  const out = mkdtempSync(join(tmpdir(), "idem-types-"));
  try {
    run(["-p", "tsconfig.json", "--declarationDir", out]);
    const want = readdirSync(out).sort();
    assert.deepEqual(readdirSync(join(root, "types")).sort(), want, "types/ holds other files than the build writes: run npm run build");
    for (const f of want) {
      assert.equal(readFileSync(join(root, "types", f), "utf8"), readFileSync(join(out, f), "utf8"),
        `types/${f} is stale: run npm run build and commit it`);
    }
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});

test("a TypeScript program using the package compiles", () => {
  run(["-p", "tsconfig.usage.json"]);
});
