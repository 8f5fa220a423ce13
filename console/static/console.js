// The one script of the console: a "select all" box on the dead-letter list. The
// console works without it.
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", function () {
    document.querySelectorAll("input[name=id]").forEach(function (b) { b.checked = all.checked; });
  });
});
