// The suspended processes (gpukillctl suspend): off the GPUs, their GPU memory held in host memory until
// resumed; "stuck" when a step failed, with its remedy. Each host's view carries them (the hub lists them with
// the processes); the overview shows a host's, the processes page every host's, apart from the running ones.

import {el} from "./dom.js";
import * as fmt from "./format.js";
import {hostName, state} from "./state.js";

// How long it has been suspended, as of now on this browser's clock (the view says when it was suspended).
function suspendedFor(r) {
  return typeof r.suspended_at === "number" && r.suspended_at > 0 ? fmt.duration(Date.now() / 1000 - r.suspended_at) : fmt.text(null);
}

// What to do next: the workload it belongs to, or a stuck process's remedy and error.
function what(r) {
  return r.state === "stuck" ? `${r.remedy}${r.error ? ` (${r.error})` : ""}` : fmt.text(r.workload);
}

// One host's (hostId given) or every host's suspended processes as a table, the longest suspended first.
export function table(rows, withHost) {
  const heads = [...(withHost ? ["host"] : []), "PID", "name", "user", "GPU", "host memory", "state", "suspended for", "workload / remedy"];
  const numeric = new Set(["PID", "GPU", "host memory", "suspended for"]);
  const sorted = [...rows].sort((a, b) => (a.suspended_at - b.suspended_at) || (a.pid - b.pid));
  return el("table", {class: "suspended-table"},
    el("thead", null, el("tr", null, heads.map((h) => el("th", {class: numeric.has(h) ? "num" : null}, h)))),
    el("tbody", null, sorted.map((r) => el("tr", {class: "suspended", dataset: {host: r.host, pid: r.pid, state: r.state}},
      withHost ? el("td", null, hostName(r.host)) : null,
      el("td", {class: "num"}, String(r.pid)), el("td", null, el("span", {class: "comm"}, fmt.text(r.comm))), el("td", null, fmt.text(r.user)),
      el("td", {class: "num"}, (r.devices || []).join(",") || fmt.text(null)), el("td", {class: "num"}, fmt.bytes(r.memory)),
      el("td", {class: `suspend-state state-${r.state}`}, r.state), el("td", {class: "num"}, suspendedFor(r)),
      el("td", {class: "suspend-what"}, what(r))))));
}

// "2 processes, 16.0 GiB held in host memory"
export function summary(rows) {
  const held = rows.reduce((sum, r) => sum + (r.memory || 0), 0);
  return `${rows.length} process${rows.length === 1 ? "" : "es"}, ${fmt.bytes(held)} of GPU memory held in host memory`;
}

// Every host's suspended processes that are up, each record with its host.
export function all() {
  const out = [];
  for (const host of state.hosts) {
    const view = state.views.get(host.id);
    if (!view || view.state !== "up") continue;
    for (const r of view.suspended || []) out.push({...r, host: host.id});
  }
  return out;
}
