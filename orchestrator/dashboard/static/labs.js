// The state labs: each Step asks the server for the whole history up to k (one source of truth,
// orchestrator/dashboard/labs.py) and shows the visible state beside that history.
(function () {
  "use strict";

  function format(value) {
    return Number.isInteger(value) ? String(value) : String(Number(value.toPrecision(10)));
  }

  function setup(lab) {
    let step = 0;
    let latest = 0;  // answers can arrive out of order: show only the newest request's
    const input = (name) => lab.querySelector(`input[name="${name}"]`);
    const params = Array.from(lab.querySelectorAll(".controls input")).filter((i) => !i.name.startsWith("predict"));

    async function show() {
      const query = new URLSearchParams({steps: String(step)});
      for (const i of params) query.set(i.name, i.value);
      const at = input("predict_at").value, guess = input("predict").value;
      if (at !== "" && guess !== "") { query.set("predict_at", at); query.set("predict", guess); }
      const mine = ++latest;
      const response = await fetch(`${lab.dataset.api}?${query}`, {cache: "no-store"});
      const body = await response.json();
      if (mine !== latest) return;
      const verdict = lab.querySelector(".verdict");
      if (!response.ok) {
        verdict.textContent = body.detail || "invalid parameters";
        verdict.className = "verdict wrong";
        return;
      }
      lab.querySelector(".state").textContent = format(body.state);
      lab.querySelector(".step").textContent = String(body.step);
      const list = lab.querySelector(".history");
      list.replaceChildren(...body.history.map((v) => {
        const li = document.createElement("li");
        li.textContent = format(v);
        return li;
      }));
      const p = body.prediction;
      if (!p) {
        verdict.textContent = "";
        verdict.className = "verdict";
      } else if (p.matches === null) {
        verdict.textContent = `prediction for step ${p.at}: ${format(p.value)} (not reached yet)`;
        verdict.className = "verdict pending";
      } else {
        verdict.textContent = `prediction for step ${p.at}: ${format(p.value)}, actual ${format(p.actual)}: ` +
          (p.matches ? "✓ right" : "✗ wrong");
        verdict.className = p.matches ? "verdict right" : "verdict wrong";
      }
      lab.dataset.step = String(step);
    }

    lab.addEventListener("click", (event) => {
      const action = event.target.dataset && event.target.dataset.action;
      if (action === "reset") step = 0;
      else if (action === "step") step += 1;
      else return;
      show();
    });
    for (const i of params) i.addEventListener("change", () => { step = 0; show(); });
    show();
  }

  document.querySelectorAll(".lab").forEach(setup);
})();
