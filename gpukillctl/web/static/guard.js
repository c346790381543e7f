// The Guard page, for the chosen host: its switches, the rules in force with their counters, recent actions;
// a pasted policy tested against the host's live processes (nothing is done: its decisions are listed); and
// the managed user, group and GPU policies, listed, set and removed (polkit decides, as for gpukillctl).

import {call, failure} from "./api.js";
import {$, el, replace} from "./dom.js";
import {flash} from "./flash.js";
import * as fmt from "./format.js";
import {selectedHost} from "./state.js";

function table(id, headers, rows) {
  return el("table", {id},
    el("thead", null, el("tr", null, headers.map((h) => el("th", null, h)))),
    el("tbody", null, rows.map((cells) => el("tr", null, cells.map((c) => el("td", null, c))))));
}

function renderStatus(status) {
  const switches = el("dl", {class: "facts"},
    el("dt", null, "enabled"), el("dd", {id: "guard-enabled"}, status.enabled ? "yes" : "no"),
    el("dt", null, "dry run"), el("dd", {id: "guard-dry-run"}, status.dry_run || status.policy_dry_run ? "yes" : "no"),
    // What holds dry run on, and where the policy came from, as `gpukillctl guard status` says them.
    status.dry_run_kept ? [el("dt", null, "dry run kept"), el("dd", {id: "guard-dry-run-kept"}, status.dry_run_kept)]
      : null,
    el("dt", null, "policy from"), el("dd", {id: "guard-source"}, `${status.source}: ${status.files.join(", ") || "–"}`
      + (status.loaded_by ? `, loaded by ${status.loaded_by} at ${fmt.clock(status.loaded_at)}` : "")),
    status.replaced ? [el("dt", null, "replaced"), el("dd", {id: "guard-replaced"},
      `${status.replaced} (at ${fmt.clock(status.replaced_at)}, by a re-read of guard.d)`)] : null,
    el("dt", null, "evaluations"), el("dd", null, `${status.evaluations} (last ${status.last_eval_ms.toFixed(1)} ms)`),
    status.policy_error ? [el("dt", null, "policy error"), el("dd", {class: "error"}, status.policy_error)] : null);
  const rules = table("guard-rules", ["rule", "action", "scope", "conditions", "triggers", "kills", "would kill", "cancelled", "failed", "last"],
    status.rules.map((r) => [r.name, r.action, r.scope, r.conditions.join(` ${r.match} `), String(r.triggers),
      String(r.kills), String(r.would_kill), String(r.cancelled), String(r.failed), fmt.clock(r.last_triggered)]));
  const recent = table("guard-recent", ["time", "rule", "event", "subject", "action", "outcome"],
    [...status.recent].reverse().map((e) => [fmt.clock(e.time), e.rule, e.event + (e.dry_run ? " (dry run)" : "")
      + (e.repeats ? ` (×${e.repeats} since ${fmt.clock(e.since)})` : ""), e.subject, e.action, e.outcome]));
  // Delivered: written to a terminal, accepted by the mail server or webhook; the desktop only announces (no
  // agent answers whether it showed a notice), so its row has that count alone.
  const counts = (c) => c.channel === "desktop" ? ["–", "–", "–", "–", String(c.announced)]
    : [String(c.delivered), String(c.skipped), String(c.failed), String(c.dropped), "–"];
  const notices = table("guard-notifications", ["channel", "delivered", "skipped", "failed", "dropped", "announced"],
    Object.entries(status.notifications).map(([channel, c]) => [channel, ...counts({...c, channel})]));
  // Graces are red as in `gpukillctl top`: a kill is counting down; windows are conditions holding, not yet long enough.
  // An owner's postponements (gpukillctl postpone): "20m by alice: saving"
  const postponed = (g) => g.postponements
    ? `${fmt.duration(g.postponed)}${g.postponements > 1 ? ` in ${g.postponements}` : ""}`
      + (g.postponed_by ? ` by ${g.postponed_by}` : "") + (g.postpone_reason ? `: ${g.postpone_reason}` : "")
    : "–";
  const graces = el("table", {id: "guard-graces"},
    el("thead", null, el("tr", null, ["rule", "subject", "left", "warnings", "postponed"].map((h) => el("th", null, h)))),
    el("tbody", null, status.graces.map((g) => el("tr", {class: "grace"}, el("td", null, g.rule), el("td", null, g.subject),
      el("td", {class: "num"}, fmt.duration(g.remaining)), el("td", {class: "num"}, String(g.warnings_sent)),
      el("td", null, postponed(g))))));
  const windows = table("guard-windows", ["rule", "subject", "condition", "held", "of"],
    status.windows.map((w) => [w.rule, w.subject, w.condition, fmt.duration(w.elapsed), fmt.duration(w.duration)]));
  replace($("#guard-status"), switches, el("h3", null, "Rules in force"), rules,
    el("h3", null, "In a grace period"), status.graces.length ? graces : el("p", {class: "muted"}, "None."),
    el("h3", null, "In a duration window"), status.windows.length ? windows : el("p", {class: "muted"}, "None."),
    el("h3", null, "Recent actions"), status.recent.length ? recent : el("p", {class: "muted"}, "None yet."),
    el("h3", null, "Notifications"), notices);
}

function renderDecisions(decisions) {
  replace($("#guard-decisions"), decisions.length === 0 ? el("p", {class: "muted"}, "The policy would do nothing now.")
    : table("decisions", ["rule", "subject", "action", "status", "wait", "PIDs", "reason"],
      decisions.map((d) => [d.rule, d.subject, d.action, d.status === "truncated" ? `${d.more} more` : d.status,
        d.status === "not-met" ? "–" : fmt.duration(d.wait), d.pids.join(" "), d.reason])));
}

function renderManaged(policies) {
  const settings = (p) => [
    p.memory_limit != null ? `memory ${fmt.bytes(p.memory_limit)}` : null,
    p.utilization_limit != null ? `utilization ${p.utilization_limit} %` : null,
    p.process_limit != null ? `processes ${p.process_limit}` : null,
    p.allowed_users && p.allowed_users.length ? `users ${p.allowed_users.join(",")}` : null, // null: anyone
    p.reserved_memory != null ? `reserved ${fmt.bytes(p.reserved_memory)}` : null,
    `grace ${fmt.duration(p.grace)}`,
  ].filter(Boolean).join("; ");
  replace($("#managed-list"), policies.length === 0 ? el("p", {class: "muted"}, "No managed policy.")
    : el("table", {id: "managed"},
      el("thead", null, el("tr", null, ["kind", "target", "settings", "file", ""].map((h) => el("th", null, h)))),
      el("tbody", null, policies.map((p) => el("tr", {dataset: {kind: p.kind, target: p.target}},
        el("td", null, p.kind), el("td", null, p.target), el("td", null, settings(p)),
        el("td", null, p.file + (p.edited ? " (edited by hand)" : "")),
        el("td", null, el("button", {type: "button", class: "remove-policy"}, "remove")))))));
}

export async function render() {
  const {api} = selectedHost();
  const [status, managed] = await Promise.all([call(api, "/guard/status"), call(api, "/guard/policies")]);
  if (status.ok) renderStatus(status.body);
  else replace($("#guard-status"), el("p", {class: "error"}, failure(status)));
  if (managed.ok) renderManaged(managed.body.policies);
  else replace($("#managed-list"), el("p", {class: "error"}, failure(managed)));
}

async function testPolicy() {
  const {api} = selectedHost();
  const result = await call(api, "/guard/test", {method: "POST",
    body: {name: $("#policy-name").value || "pasted", text: $("#policy-text").value}});
  if (result.ok) renderDecisions(result.body.decisions);
  else replace($("#guard-decisions"), el("p", {class: "error"}, failure(result)));
}

function managedBody() {
  const body = {};
  // sizes and the grace go as typed: the server reads them in gpukill's one grammar (8GiB, 90s, 2min) and
  // answers a one-line error naming the field
  const texts = {memory_limit: "#mp-memory", reserved_memory: "#mp-reserved", grace: "#mp-grace"};
  for (const [field, input] of Object.entries(texts)) {
    const text = $(input).value.trim();
    if (text !== "") body[field] = text;
  }
  const numbers = {utilization_limit: "#mp-utilization", process_limit: "#mp-processes"};
  for (const [field, input] of Object.entries(numbers)) {
    const text = $(input).value.trim();
    if (text === "") continue;
    const value = Number(text);
    if (!Number.isFinite(value)) throw new Error(`${field}: not a number`);
    body[field] = value;
  }
  const users = $("#mp-users").value.split(",").map((u) => u.trim()).filter(Boolean);
  if (users.length) body.allowed_users = users;
  return body;
}

async function setPolicy() {
  const {api} = selectedHost();
  const kind = $("#mp-kind").value;
  const target = $("#mp-target").value.trim();
  let body;
  try {
    body = managedBody();
  } catch (e) {
    flash("error", e.message);
    return;
  }
  const result = await call(api, `/guard/policies/${encodeURIComponent(kind)}/${encodeURIComponent(target)}`,
    {method: "PUT", body});
  flash(result.ok ? "ok" : "error", result.ok ? `policy for ${kind} ${target} set` : failure(result));
  render();
}

async function removePolicy(kind, target) {
  const {api} = selectedHost();
  const result = await call(api, `/guard/policies/${encodeURIComponent(kind)}/${encodeURIComponent(target)}`,
    {method: "DELETE"});
  flash(result.ok ? "ok" : "error", result.ok ? `policy for ${kind} ${target} removed` : failure(result));
  render();
}

export function init() {
  $("#policy-test").addEventListener("click", testPolicy);
  $("#mp-set").addEventListener("click", setPolicy);
  $("#guard-refresh").addEventListener("click", render);
  $("#managed-list").addEventListener("click", (e) => {
    const button = e.target.closest("button.remove-policy");
    if (button) {
      const row = button.closest("tr");
      removePolicy(row.dataset.kind, row.dataset.target);
    }
  });
}
