// spotrun dashboard: refresh a running job's page in place, and verify checksums on demand.
// The page is rendered on the server; this script only swaps in a fresh #content.
(function () {
  "use strict";
  const interval = Number(document.body.dataset.refreshMs || 2000);

  function live() {
    const content = document.getElementById("content");
    return content && content.dataset.refresh === "1";
  }

  async function refresh() {
    const response = await fetch(location.pathname + location.search, {cache: "no-store", headers: {Accept: "text/html"}});
    if (!response.ok) return;
    const doc = new DOMParser().parseFromString(await response.text(), "text/html");
    const fresh = doc.getElementById("content");
    const current = document.getElementById("content");
    if (fresh && current) current.replaceWith(fresh);
  }

  function loop() {
    if (!live()) return;
    refresh().catch(() => undefined).finally(() => setTimeout(loop, interval));
  }

  setTimeout(loop, interval);

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("[data-verify]");
    if (!button) return;
    button.disabled = true;
    button.textContent = "Verifying…";
    try {
      await fetch(button.dataset.verify, {cache: "no-store"});
    } finally {
      await refresh();
    }
  });
})();
