// jaxdecode rdu report: overlay selector, mapping selector, expand/collapse. No dependencies.
(function () {
  "use strict";
  var METRICS = ["time", "flops", "bytes"];

  function setOverlay(metric) {
    var k = METRICS.indexOf(metric);
    document.body.classList.toggle("by-kind", k < 0);
    document.querySelectorAll("#graph [data-c]").forEach(function (el) {
      var target = el.tagName === "g" ? el.querySelector("rect") : el;
      var color = k < 0 ? "" : el.getAttribute("data-c").split(" ")[k];
      if (el.tagName === "g") target.style.fill = color;
      else target.style.background = color;
    });
    document.querySelectorAll(".legend-range").forEach(function (el) {
      el.hidden = el.getAttribute("data-metric") !== metric;
    });
  }

  function showGrid() {
    var s = document.getElementById("grid-sockets").value;
    var k = document.getElementById("grid-kernel").value;
    var any = false;
    document.querySelectorAll(".gridview").forEach(function (el) {
      var on = el.getAttribute("data-s") === s && el.getAttribute("data-k") === k;
      el.hidden = !on;
      any = any || on;
    });
    document.getElementById("grid-none").hidden = any;
  }

  function setAll(root, open) {
    root.querySelectorAll("details").forEach(function (d) { d.open = open; });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var overlay = document.getElementById("overlay");
    overlay.addEventListener("change", function () { setOverlay(overlay.value); });
    setOverlay(overlay.value);
    var gs = document.getElementById("grid-sockets"), gk = document.getElementById("grid-kernel");
    if (gs && gk) {
      gs.addEventListener("change", showGrid);
      gk.addEventListener("change", showGrid);
      showGrid();
    }
    document.getElementById("expand-all").addEventListener("click", function () {
      setAll(document.getElementById("graph"), true);
    });
    document.getElementById("collapse-all").addEventListener("click", function () {
      setAll(document.getElementById("graph"), false);
    });
  });
})();
