// sextant compile report: open the collapsed sections that hold a link's target, and expand/collapse all.
"use strict";
(function () {
  function reveal(id) {
    var el = id && document.getElementById(id);
    if (!el) return;
    for (var p = el; p; p = p.parentElement) {
      if (p.tagName === "DETAILS") p.open = true;
    }
    el.scrollIntoView({ block: "start" });
  }
  window.addEventListener("hashchange", function () { reveal(decodeURIComponent(location.hash.slice(1))); });
  document.addEventListener("DOMContentLoaded", function () {
    if (location.hash) reveal(decodeURIComponent(location.hash.slice(1)));
    document.querySelectorAll("button[data-details]").forEach(function (b) {
      b.addEventListener("click", function () {
        var open = b.getAttribute("data-details") === "open";
        document.querySelectorAll("details").forEach(function (d) { d.open = open; });
      });
    });
    document.body.setAttribute("data-ready", "1");
  });
})();
