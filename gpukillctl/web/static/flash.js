// #flash: the outcome of the last act, or the daemon's answer exactly as it came (polkit's refusal, say).

import {$} from "./dom.js";

export function flash(kind, message) {
  const box = $("#flash");
  box.dataset.kind = kind; // "ok" or "error"
  box.textContent = message;
  box.hidden = false;
}
