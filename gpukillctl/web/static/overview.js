// The overview: a section per host (its state, the error of a host that does not answer), a card per GPU
// (utilization and memory bars, temperature, power, state), and the processes holding GPU memory at 0%
// utilization for long: the memory to reclaim; the suspended processes, their memory held in host memory.

import {$, bar, el, replace} from "./dom.js";
import * as fmt from "./format.js";
import {hostName, state} from "./state.js";
import * as suspended from "./suspended.js";

function gpuCard(hostId, device, processes) {
  const memPct = device.memory_total ? (100 * (device.memory_used ?? 0)) / device.memory_total : null;
  const memLabel = device.memory_used == null ? "memory –"
    : `${fmt.bytes(device.memory_used)} of ${fmt.bytes(device.memory_total)}`;
  const stateText = device.state === "ok" ? "ok" : `${device.state}${device.state_reason ? ": " + device.state_reason : ""}`;
  return el("article", {class: "gpu", dataset: {host: hostId, index: device.index, state: device.state}},
    el("header", null, el("span", {class: "gpu-index"}, `GPU ${device.index}`), " ", el("span", {class: "gpu-name"}, device.name)),
    el("div", {class: "gpu-row"}, el("span", {class: "gpu-key"}, "utilization"),
       bar(device.utilization, fmt.percent(device.utilization), fmt.load(device.utilization, fmt.UTIL_LEVELS))),
    el("div", {class: "gpu-row"}, el("span", {class: "gpu-key"}, "memory"),
       bar(memPct, memLabel, fmt.load(device.memory_used == null ? null : memPct, fmt.MEMORY_LEVELS))),
    el("dl", {class: "gpu-facts"},
       el("dt", null, "temperature"),
       el("dd", {class: `gpu-temp load-${fmt.load(device.temperature, fmt.TEMPERATURE_LEVELS, "") || "none"}`},
          fmt.celsius(device.temperature)),
       el("dt", null, "power"), el("dd", {class: "gpu-power"}, fmt.watts(device.power)),
       el("dt", null, "state"), el("dd", {class: `gpu-state state-${device.state}`}, stateText),
       el("dt", null, "processes"), el("dd", null, String(processes))));
}

function reclaimTable(hostId, idle) {
  if (idle.length === 0) return el("p", {class: "muted"}, "Nothing held idle.");
  return el("table", {class: "reclaim-table"},
    el("thead", null, el("tr", null, ["PID", "name", "user", "GPU", "memory", "idle for"]
      .map((h, i) => el("th", {class: [0, 3, 4, 5].includes(i) ? "num" : null}, h)))),
    el("tbody", null, idle.map((p) => el("tr", {class: "reclaim", dataset: {host: hostId, pid: p.pid}},
      el("td", {class: "num"}, String(p.pid)), el("td", null, p.comm), el("td", null, p.user),
      el("td", {class: "num"}, String(p.device)), el("td", {class: "num"}, fmt.bytes(p.gpu_memory)),
      el("td", {class: "num"}, fmt.duration(p.idle_seconds))))));
}

function hostSection(host, view, idleAfter) {
  const viewState = view ? view.state : "connecting";
  const devices = view ? view.devices : [];
  const processes = view ? view.processes : [];
  const held = view && view.suspended ? view.suspended : [];
  const perDevice = new Map();
  for (const p of processes) perDevice.set(p.device, (perDevice.get(p.device) || 0) + 1);
  const idle = processes.filter((p) => typeof p.idle_seconds === "number" && p.idle_seconds >= idleAfter
    && (p.gpu_memory ?? 0) > 0).sort((a, b) => (b.gpu_memory ?? 0) - (a.gpu_memory ?? 0));
  return el("section", {class: "host", dataset: {host: host.id, state: viewState}},
    el("h2", null, el("span", {class: "host-name"}, hostName(host.id)), " ",
       el("span", {class: `badge state-${viewState}`}, viewState)),
    el("p", {class: "host-error"}, view && view.error ? view.error : ""),
    el("div", {class: "gpus"}, devices.map((d) => gpuCard(host.id, d, perDevice.get(d.index) || 0))),
    viewState === "up" && devices.length === 0 ? el("p", {class: "muted"}, "No GPU found.") : null,
    el("h3", null, "Held but idle: memory to reclaim"),
    reclaimTable(host.id, idle),
    held.length ? el("h3", null, "Suspended: ", el("span", {class: "muted"}, suspended.summary(held))) : null,
    held.length ? suspended.table(held.map((r) => ({...r, host: host.id})), false) : null);
}

export function render() {
  const idleAfter = Number($("#idle-after").value);
  replace($("#hosts-overview"), state.hosts.map((h) => hostSection(h, state.views.get(h.id), idleAfter)));
}

// One host's section only (its view changed): a lab of many hosts does not redraw every card on each change.
export function renderHost(id) {
  const old = $(`#hosts-overview section.host[data-host="${Number(id)}"]`);
  const host = state.hosts.find((h) => h.id === id);
  if (!old || !host) return render();
  old.replaceWith(hostSection(host, state.views.get(id), Number($("#idle-after").value)));
}

export function init(rerender) {
  $("#idle-after").addEventListener("change", rerender);
}
