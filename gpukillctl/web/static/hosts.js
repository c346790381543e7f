// The hosts the server shows (/ui/hosts), and the selector of the host that the guard, audit and usage
// pages ask (shown where there are several).

import {call, failure} from "./api.js";
import {$, el, replace} from "./dom.js";
import {flash} from "./flash.js";
import {emit, state} from "./state.js";

export async function load() {
  const result = await call("", "/ui/hosts");
  if (!result.ok) {
    flash("error", failure(result));
    return;
  }
  state.hosts = result.body.hosts;
  const select = $("#host-select");
  replace(select, state.hosts.map((h) => el("option", {value: h.id}, h.name)));
  select.value = String(state.selected);
  $("#host-picker").hidden = state.hosts.length < 2;
  emit("hosts");
}

export function init() {
  $("#host-select").addEventListener("change", (e) => {
    state.selected = Number(e.target.value);
    emit("selected");
  });
}
