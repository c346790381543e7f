// The audit page: the chosen host's rogue findings (miners, abusers, idle holders), highest score first,
// each with its evidence as the viewer may see it (a process chose part of that text: shown as text).

import {call, failure} from "./api.js";
import {$, el, replace} from "./dom.js";
import * as fmt from "./format.js";
import {selectedHost} from "./state.js";

function evidence(items) {
  return el("ul", {class: "evidence"}, items.map((e) =>
    el("li", null, el("span", {class: "rule"}, e.rule), ` +${e.points}: `, el("span", {class: "detail"}, e.detail))));
}

export async function render() {
  const result = await call(selectedHost().api, "/audit/rogue");
  if (!result.ok) {
    replace($("#audit-findings"), el("p", {class: "error"}, failure(result)));
    return;
  }
  const findings = result.body.findings;
  replace($("#audit-findings"), findings.length === 0 ? el("p", {class: "muted"}, "No finding.")
    : el("table", {id: "findings"},
      el("thead", null, el("tr", null, ["kind", "score", "user", "PID", "name", "GPUs", "memory", "evidence"]
        .map((h, i) => el("th", {class: [1, 3, 6].includes(i) ? "num" : null}, h)))),
      el("tbody", null, findings.map((f) => el("tr", {class: `finding kind-${f.kind}`, dataset: {pid: f.pid ?? ""}},
        el("td", null, f.kind), el("td", {class: "num"}, String(f.score)), el("td", null, f.user),
        el("td", {class: "num"}, fmt.text(f.pid)), el("td", null, fmt.text(f.comm)),
        el("td", null, f.devices.join(" ")), el("td", {class: "num"}, fmt.bytes(f.gpu_memory)),
        el("td", null, evidence(f.evidence)))))));
}

export function init() {
  $("#audit-refresh").addEventListener("click", render);
}
