// The dashboard's entry point: routes by hash (#/overview, #/processes, #/guard, #/audit, #/usage,
// #/events), feeds the live pages from the stream and asks the others' data when they are opened.
// body[data-ready="1"] once every host's first view has been drawn (the tests and the bench wait on it).

import * as audit from "./audit.js";
import {$} from "./dom.js";
import * as events from "./events.js";
import * as guard from "./guard.js";
import * as hosts from "./hosts.js";
import * as kill from "./kill.js";
import * as overview from "./overview.js";
import * as processes from "./processes.js";
import * as session from "./session.js";
import {emit, on, state} from "./state.js";
import {subscribe} from "./stream.js";
import * as usage from "./usage.js";

const PAGES = {overview, processes, guard, audit, usage, events: null};
const LIVE = new Set(["overview", "processes"]); // drawn from the stream; the others are asked on opening
let current = "overview";
let drawPending = false;
const changedHosts = new Set();

function pageFromHash() {
  const name = location.hash.replace(/^#\/?/, "");
  return Object.hasOwn(PAGES, name) ? name : "overview";
}

function markReady() {
  if (document.body.dataset.ready || !state.hosts.length || !state.hosts.every((h) => state.views.has(h.id))) return;
  document.body.dataset.ready = "1";
  performance.mark("gpukill-ready"); // bench/dashboard_render reads these two marks
}

// Draw the live page once for any number of changes that came together.
function drawSoon(hostId) {
  if (hostId !== undefined) changedHosts.add(hostId);
  else changedHosts.add("all");
  if (drawPending) return;
  drawPending = true;
  setTimeout(() => {
    drawPending = false;
    const all = changedHosts.has("all");
    const changed = [...changedHosts];
    changedHosts.clear();
    if (current === "processes") processes.render();
    else if (current === "overview") {
      if (all) overview.render();
      else for (const id of changed) overview.renderHost(id);
    }
    markReady();
  }, 0);
}

function show(name) {
  if (name !== current) $("#flash").hidden = true; // an answer belongs to the page it was given on
  current = name;
  for (const section of document.querySelectorAll("main > section[data-page]")) section.hidden = section.dataset.page !== name;
  for (const link of document.querySelectorAll("nav a[data-page]")) {
    link.classList.toggle("current", link.dataset.page === name);
    if (link.dataset.page === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (LIVE.has(name)) drawSoon();
  else if (PAGES[name]) PAGES[name].render();
}

function onStream(message) {
  if (message.kind === "host") {
    if (state.views.size === 0) performance.mark("gpukill-first-view");
    message.view.receivedAt = Date.now() / 1000; // what the processes page counts runtimes on from
    state.views.set(message.view.id, message.view);
    emit("host", message.view.id);
  } else if (message.kind === "signal") {
    events.add(message.signal);
  } else if (message.kind === "stream") {
    $("#stream-state").dataset.state = message.state;
    $("#stream-state").textContent = message.state === "open" ? "live" : message.state;
  }
}

function start() {
  session.keep(); // before anything asks the server: the login's redirect brings the page's half
  for (const module of [overview, processes, guard, audit, usage, kill, hosts]) module.init(() => drawSoon());
  on("host", (id) => drawSoon(id));
  on("hosts", () => drawSoon());
  on("selected", () => { if (!LIVE.has(current) && PAGES[current]) PAGES[current].render(); });
  addEventListener("hashchange", () => show(pageFromHash()));
  $("#flash").addEventListener("click", () => { $("#flash").hidden = true; });
  // Runtimes go on between changes: the processes page redraws them each second (no request: the same views).
  setInterval(() => { if (current === "processes" && !document.hidden) drawSoon(); }, 1000);
  show(pageFromHash());
  hosts.load();
  subscribe(onStream);
}

start();
