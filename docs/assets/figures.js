// qsa_lab's site: a click on a figure shows it at full size over the page (mkdocs.yml,
// extra_javascript); a click anywhere or Escape closes it. Notebook figures are inline data, so a
// link to the file is not enough; figures of the pages are links to their files as well.
(function () {
  function close() {
    document.querySelectorAll(".qsa-lightbox").forEach(function (el) { el.remove(); });
  }
  function open(src, alt) {
    close();
    var box = document.createElement("div");
    box.className = "qsa-lightbox";
    box.setAttribute("role", "dialog");
    box.setAttribute("aria-label", "figure at full size (click or Escape to close)");
    var img = document.createElement("img");
    img.src = src;
    img.alt = alt || "";
    var x = document.createElement("span");
    x.className = "qsa-lightbox-close";
    x.textContent = "\u00d7";
    box.appendChild(img);
    box.appendChild(x);
    box.addEventListener("click", close);
    document.body.appendChild(box);
  }
  document.addEventListener("click", function (event) {
    var img = event.target.closest && event.target.closest("article img");
    if (!img || img.closest(".qsa-lightbox") || img.naturalWidth < 64) return;
    event.preventDefault();
    open(img.currentSrc || img.src, img.alt);
  });
  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape") close();
  });
})();
