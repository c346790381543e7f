// The events page: the signals of every host as they come (newest first, the last MAX_ROWS kept).

import {$, el} from "./dom.js";
import * as fmt from "./format.js";
import {hostName} from "./state.js";

const MAX_ROWS = 500;

// One line saying what happened; the record's fields as text (a process chose its name: text nodes only).
function summary(signal) {
  const r = signal.record || {};
  switch (signal.type) {
    case "ProcessKilled": return `PID ${r.pid} (${r.comm}) of uid ${r.uid}: ${r.outcome}, by ${r.initiator}`;
    case "DeviceReset": return `GPU ${r.index}: ${r.success ? "reset" : "not reset"}: ${r.message}`;
    case "ProcessSuspended":
    case "ProcessResumed": {
      const p = r.process || {};
      const act = signal.type === "ProcessSuspended" ? "suspended" : p.state === "running" ? "resumed" : `${p.state}: ${p.remedy}`;
      return `PID ${p.pid} (${p.comm}) of uid ${p.uid} on GPU ${(p.devices || []).join(",")}: ${act}, ${fmt.bytes(p.memory)}, by uid ${r.caller_uid}`;
    }
    case "DeviceStateChanged": return `GPU ${r.index}: ${r.state}${r.reason ? ": " + r.reason : ""}`;
    default: return Object.entries(r).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
  }
}

export function add(signal) {
  const body = $("#events tbody");
  body.insertBefore(el("tr", {class: "event", dataset: {host: signal.host, type: signal.type}},
    el("td", null, fmt.clock(signal.at)), el("td", null, hostName(signal.host)),
    el("td", null, signal.type), el("td", null, summary(signal))), body.firstChild);
  while (body.children.length > MAX_ROWS) body.lastChild.remove();
  $("#events-empty").hidden = true;
}
