// What the page knows: the hosts (/ui/hosts), the newest view of each (from the stream), the host chosen for
// the pages that ask one host (guard, audit, usage), and who wants to hear of a change.

export const state = {
  hosts: [], // [{id, name, api}] as /ui/hosts lists them
  views: new Map(), // host id → HostView (the hub's)
  selected: 0, // the host the guard, audit and usage pages ask, and where their actions go
  signals: [], // newest first, bounded (events page)
};

const listeners = {host: new Set(), signal: new Set(), hosts: new Set(), selected: new Set()};

export function on(what, listener) {
  listeners[what].add(listener);
}

export function emit(what, detail) {
  for (const listener of listeners[what]) listener(detail);
}

export function hostById(id) {
  return state.hosts.find((h) => h.id === id);
}

export function hostName(id) {
  const host = hostById(id);
  return host ? host.name : state.views.get(id)?.name ?? `host ${id}`;
}

export function selectedHost() {
  return hostById(state.selected) || state.hosts[0] || {id: 0, name: "", api: "/v1"};
}
