// The one script of the console: a "select all" box on the dead-letter list, and
// the overview's live part read again every few seconds, without reloading the
// page (the server renders it: the script only swaps it in). The console works
// without it.
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      document.querySelectorAll("input[name=id]").forEach(function (b) { b.checked = all.checked; });
    });
  }

  var live = document.getElementById("live");
  if (!live || !live.dataset.src || !window.fetch || !window.DOMParser) return;
  var every = parseInt(live.dataset.every, 10) || 5000;
  var busy = false;
  var refresh = function () {
    if (busy || document.hidden) return;
    busy = true;
    fetch(live.dataset.src, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.text();
      })
      .then(function (html) {
        var next = new DOMParser().parseFromString(html, "text/html").getElementById("live");
        if (!next) throw new Error("no live part in the answer");
        next = document.importNode(next, true);
        live.replaceWith(next);
        live = next;
      })
      .catch(function (e) {
        var status = document.getElementById("live-status");
        if (status) {
          status.textContent = "Refreshing failed (" + e.message + "); trying again in " + every / 1000 + " s.";
          status.className = "warn";
        }
      })
      .then(function () { busy = false; });
  };
  setInterval(refresh, every);
});
