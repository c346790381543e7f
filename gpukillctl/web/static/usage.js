// The usage page: the chosen host's accounting totals grouped by user, unit, job, pod or GPU over a chosen
// range, as bar charts (SVG: geometry in attributes, labels as text nodes) and a table of the figures.

import {call, failure} from "./api.js";
import {$, el, replace, svg} from "./dom.js";
import * as fmt from "./format.js";
import {selectedHost} from "./state.js";

const MAX_BARS = 20;
const ROW = 22; // px per bar
const LABEL = 160; // px for the labels on the left
const WIDTH = 640;
const LABEL_CHARS = 20; // what fits in LABEL px at the labels' 12px (most characters are under 7.5px)

// A label cut to the space on its left, keeping its start and its end (a unit's name may be 255 characters).
function shortened(text) {
  if (text.length <= LABEL_CHARS) return text;
  const tail = Math.floor((LABEL_CHARS - 1) / 2);
  return `${text.slice(0, LABEL_CHARS - 1 - tail)}…${text.slice(-tail)}`;
}

// [title, value of a row, its text]
const CHARTS = [
  ["GPU time", (r) => r.gpu_seconds, (v) => fmt.duration(v)],
  ["GPU memory × time (GiB·h)", (r) => r.memory_byte_seconds / 2 ** 30 / 3600, (v) => v.toPrecision(3)],
  ["energy", (r) => r.energy_joules, (v) => fmt.energy(v)], // null (no power sensor): no bar, "–"
];

function label(row, by) {
  if (row.hidden) return "(not yours to see)";
  if (by === "gpu") return `GPU ${row.key}`;
  return row.key || "(none)";
}

function chart(title, rows, by, value, show) {
  const shown = rows.slice(0, MAX_BARS);
  const top = Math.max(...shown.map((r) => value(r) ?? 0), 0) || 1;
  const height = shown.length * ROW + 4;
  return el("figure", {class: "chart"}, el("figcaption", null, title),
    svg("svg", {viewBox: `0 0 ${WIDTH} ${height}`, width: WIDTH, height, role: "img", "aria-label": title},
      shown.map((r, i) => {
        const v = value(r);
        const w = Math.max(1, ((WIDTH - LABEL - 90) * (v ?? 0)) / top);
        const y = i * ROW + 2;
        const name = label(r, by);
        return svg("g", {class: "chart-row"},
          svg("text", {x: LABEL - 6, y: y + 15, "text-anchor": "end", class: "chart-label"},
            svg("title", null, name), shortened(name)), // the whole as its tooltip
          svg("rect", {x: LABEL, y, width: w.toFixed(1), height: ROW - 6, class: "chart-bar"}),
          svg("text", {x: LABEL + w + 6, y: y + 15, class: "chart-value"}, show(v)));
      })));
}

export async function render() {
  const by = $("#usage-by").value;
  const since = $("#usage-since").value;
  const query = new URLSearchParams({by, since});
  const result = await call(selectedHost().api, `/usage?${query}`);
  if (!result.ok) {
    replace($("#usage-report"), el("p", {class: "error"}, failure(result)));
    return;
  }
  const report = result.body;
  const rows = report.rows;
  const range = `${fmt.clock(report.since)} – ${fmt.clock(report.until)}, ${report.rows_total} groups`
    + (report.rebuilding ? " (being rebuilt from the journal: older records may be missing)" : "");
  replace($("#usage-report"), el("p", {class: "muted", id: "usage-range"}, range),
    rows.length === 0 ? el("p", {class: "muted"}, "No usage in this range.")
      : [el("div", {class: "charts"}, CHARTS.map(([title, value, show]) => chart(title, rows, by, value, show))),
        el("table", {id: "usage-table"},
          el("thead", null, el("tr", null, el("th", null, by),
            ["processes", "live", "GPU time", "peak memory", "energy"].map((h) => el("th", {class: "num"}, h)))),
          el("tbody", null, rows.map((r) => el("tr", null,
            el("td", null, label(r, by)), el("td", {class: "num"}, String(r.processes)), el("td", {class: "num"}, String(r.live)),
            el("td", {class: "num"}, fmt.duration(r.gpu_seconds)), el("td", {class: "num"}, fmt.bytes(r.peak_memory)),
            el("td", {class: "num"}, fmt.energy(r.energy_joules))))))]);
}

export function init() {
  $("#usage-by").addEventListener("change", render);
  $("#usage-since").addEventListener("change", render);
  $("#usage-refresh").addEventListener("click", render);
}
