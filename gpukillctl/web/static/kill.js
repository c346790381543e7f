// A kill from the page: dialog#confirm names the process (pid, name, user, host); on yes, POST {api}/kill
// with the pid and the start time it was listed with (a PID reused since is refused, never signalled), to
// the host the process is on, where that host's polkit decides. #flash shows the outcome, or the daemon's
// message exactly as it is.

import {call, failure} from "./api.js";
import {$, replace} from "./dom.js";
import {flash} from "./flash.js";
import {hostById, hostName} from "./state.js";

let pending = null; // the process the open dialog is about

export function confirmKill(process) {
  pending = process;
  replace($("#confirm-text"), `Stop PID ${process.pid} (${process.comm}) of user ${process.user} on host ${hostName(process.host)}?`);
  replace($("#confirm-cmdline"), process.cmdline);
  $("#confirm").showModal();
  $("#confirm-no").focus();
}

async function kill(process) {
  const host = hostById(process.host);
  const result = await call(host ? host.api : "/v1", "/kill", {method: "POST",
    body: {pid: process.pid, start_time: process.start_time}});
  const who = `PID ${process.pid} (${process.comm}) on ${hostName(process.host)}`;
  if (!result.ok) flash("error", failure(result));
  else if (result.body.outcome === "still-alive") flash("error", `${who}: still alive after SIGTERM's grace period`);
  else flash("ok", `${who}: ${result.body.outcome}`);
}

export function init() {
  $("#confirm-yes").addEventListener("click", () => {
    const process = pending;
    pending = null;
    $("#confirm").close();
    if (process) kill(process);
  });
  $("#confirm-no").addEventListener("click", () => { pending = null; $("#confirm").close(); });
  $("#confirm").addEventListener("cancel", () => { pending = null; });
}
