// Package browsertest starts headless Chromium for a test, through chromedp. It
// lives in the test module, the one module that carries chromedp.
//
// Without Chromium a test skips, unless IDEM_REQUIRE_BROWSER=1 (CI), where it
// fails. IDEM_CHROMIUM names the browser's binary when it is elsewhere.
package browsertest

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// Path finds the browser, or skips t (fails it under IDEM_REQUIRE_BROWSER=1).
func Path(t testing.TB) string {
	t.Helper()
	for _, p := range []string{os.Getenv("IDEM_CHROMIUM"), "/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"} {
		if p == "" {
			continue
		}
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	msg := "headless Chromium not found (install the Debian package chromium, or set IDEM_CHROMIUM)"
	if os.Getenv("IDEM_REQUIRE_BROWSER") == "1" {
		t.Fatal(msg + "; IDEM_REQUIRE_BROWSER=1 requires it")
	}
	t.Skip(msg + "; skipping the browser test (IDEM_REQUIRE_BROWSER=1 makes this a failure)")
	return ""
}

// New starts a headless Chromium with a profile of its own (a fresh temporary
// directory) and returns the context of its first tab. The browser stops when t
// ends. Further tabs of the same browser are chromedp.NewContext(ctx); cancelling
// one closes that tab, while cancelling ctx would stop the browser.
func New(t testing.TB) context.Context {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(Path(t)),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1400, 1000),
	}
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelB := chromedp.NewContext(actx)
	t.Cleanup(func() { cancelB(); cancelA() })
	start := time.Now()
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	t.Logf("chromium started in %v", time.Since(start).Round(time.Millisecond))
	return ctx
}
