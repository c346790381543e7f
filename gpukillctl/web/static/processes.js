// The processes page: every host's GPU processes in one table (owner, unit, job, pod, container, memory,
// utilization, runtime), filtered by a text and sorted by a column; below, the suspended ones (suspended.js). Rows are kept by key and only their
// cells' text is updated, so a change redraws little and a row under the pointer stays where it is.

import {$, el, replace} from "./dom.js";
import * as fmt from "./format.js";
import {confirmKill} from "./kill.js";
import {hostName, state} from "./state.js";
import * as suspended from "./suspended.js";

// [sort key, header, value of a process (for sorting), its text (for the cell)]
const COLUMNS = [
  ["host", "host", (p) => hostName(p.host), (p) => hostName(p.host)],
  ["pid", "PID", (p) => p.pid, (p) => String(p.pid)],
  ["name", "name", (p) => p.comm, null], // its own cell: name and command line
  ["user", "user", (p) => p.user, (p) => p.user],
  ["gpu", "GPU", (p) => p.device, (p) => String(p.device)],
  ["memory", "memory", (p) => p.gpu_memory ?? -1, (p) => fmt.bytes(p.gpu_memory)],
  ["utilization", "util.", (p) => p.gpu_utilization ?? -1, (p) => fmt.percent(p.gpu_utilization)],
  ["runtime", "runtime", (p) => p.runtime ?? -1, (p) => fmt.duration(p.runtime)],
  ["unit", "unit", (p) => p.unit ?? "", (p) => fmt.text(p.unit)],
  ["job", "job", (p) => p.slurm_job ?? "", (p) => fmt.text(p.slurm_job)],
  ["pod", "pod", (p) => p.pod_uid ?? "", (p) => fmt.text(p.pod_uid)],
  ["container", "container", (p) => p.container_id ?? "", (p) => fmt.text(p.container_id && p.container_id.slice(0, 12))],
];
const NUMERIC = new Set(["pid", "gpu", "memory", "utilization", "runtime"]);

let sortKey = "memory";
let descending = true;
const rows = new Map(); // key → <tr>

function key(p) {
  return `${p.host}/${p.pid}/${p.start_time}/${p.device}`;
}

// The views come when something changes, so a runtime is as of its view: advanced here by the time since the
// view arrived (this browser's clock only, which may not be the server's).
function allProcesses() {
  const out = [];
  const now = Date.now() / 1000;
  for (const host of state.hosts) {
    const view = state.views.get(host.id);
    if (!view || view.state !== "up") continue;
    const since = Math.max(0, now - view.receivedAt);
    for (const p of view.processes) {
      out.push({...p, host: host.id, runtime: typeof p.runtime === "number" ? p.runtime + since : null});
    }
  }
  return out;
}

function matches(p, needle) {
  if (!needle) return true;
  return [p.comm, p.cmdline, p.user, p.unit, p.slurm_job, p.pod_uid, p.container_id, p.workload]
    .some((v) => typeof v === "string" && v.toLowerCase().includes(needle));
}

function newRow(p) {
  const cells = COLUMNS.map(([name]) => el("td", {class: NUMERIC.has(name) ? `num col-${name}` : `col-${name}`}));
  const tr = el("tr", {class: "proc", dataset: {host: p.host, pid: p.pid, device: p.device}}, cells,
    el("td", null, el("button", {type: "button", class: "kill"}, "kill")));
  tr.gpukillProcess = p;
  return tr;
}

function update(tr, p) {
  tr.gpukillProcess = p; // what the kill button acts on: this listing's pid and start time
  COLUMNS.forEach(([name, , , show], i) => {
    const td = tr.cells[i];
    if (name === "name") {
      if (td.dataset.comm !== p.comm || td.dataset.cmdline !== p.cmdline) {
        td.dataset.comm = p.comm;
        td.dataset.cmdline = p.cmdline;
        td.replaceChildren(el("span", {class: "comm"}, p.comm), el("span", {class: "cmdline", title: p.cmdline}, p.cmdline));
      }
      return;
    }
    const text = show(p);
    if (td.textContent !== text) {
      td.textContent = text;
      if (name === "unit") td.title = text; // the column cuts a long one (app.css)
    }
    if (name === "utilization") td.dataset.load = fmt.load(p.gpu_utilization, fmt.UTIL_LEVELS);
  });
}

export function render() {
  const needle = $("#filter").value.trim().toLowerCase();
  const column = COLUMNS.find(([name]) => name === sortKey);
  const value = column[2];
  const shown = allProcesses().filter((p) => matches(p, needle));
  shown.sort((a, b) => {
    const x = value(a), y = value(b);
    const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
    return (descending ? -order : order) || a.pid - b.pid;
  });
  const body = $("#processes tbody");
  const seen = new Set();
  shown.forEach((p, i) => {
    const k = key(p);
    seen.add(k);
    let tr = rows.get(k);
    if (!tr) rows.set(k, (tr = newRow(p)));
    update(tr, p);
    if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
  });
  for (const [k, tr] of rows) {
    if (!seen.has(k)) { tr.remove(); rows.delete(k); }
  }
  $("#process-count").textContent = `${shown.length} shown`;
  const held = suspended.all().filter((r) => matches(r, needle));
  $("#suspended-section").hidden = held.length === 0;
  $("#suspended-count").textContent = held.length ? `(${suspended.summary(held)})` : "";
  replace($("#suspended"), held.length ? suspended.table(held, state.hosts.length > 1) : null);
  $("#processes").classList.toggle("one-host", state.hosts.length < 2);
  for (const th of document.querySelectorAll("#processes th[data-sort]")) {
    th.setAttribute("aria-sort", th.dataset.sort === sortKey ? (descending ? "descending" : "ascending") : "none");
  }
}

export function init() {
  const headRow = $("#processes thead tr");
  headRow.replaceChildren(...COLUMNS.map(([name, header]) => el("th", {class: `col-${name}${NUMERIC.has(name) ? " num" : ""}`, dataset: {sort: name}, tabindex: 0}, header)),
    el("th", null, ""));
  headRow.addEventListener("click", (e) => {
    const th = e.target.closest("th[data-sort]");
    if (!th) return;
    if (th.dataset.sort === sortKey) descending = !descending;
    else { sortKey = th.dataset.sort; descending = NUMERIC.has(sortKey); }
    render();
  });
  $("#filter").addEventListener("input", render);
  $("#processes tbody").addEventListener("click", (e) => {
    const button = e.target.closest("button.kill");
    if (button) confirmKill(button.closest("tr").gpukillProcess);
  });
}
