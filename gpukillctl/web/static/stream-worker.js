// One stream of /ui/stream for every tab of this browser (a SharedWorker): 32 open tabs are one
// subscriber of the hub, not 32. Each tab connects a port and hands over the session's page secret (a worker
// reads no localStorage); it gets the newest view of every host at once (the hub sent those when this stream
// opened), the signals kept so far, then every event as it comes.
// Messages from a tab: {kind: "session", secret}, "bye". Messages to a tab: {kind: "host", view},
// {kind: "signal", signal}, {kind: "stream", state: "open"|"connecting"|"closed"}.

import {HEADER} from "./session.js";
import {readStream} from "./sse.js";

const KEPT_SIGNALS = 500; // as many as the events page shows
const views = new Map(); // host id → its newest HostView
const signals = []; // oldest first
const ports = new Set();
let secret = "";
let stop = null; // closes the open stream
let retry = null; // the timer of the next try
let retryMs = 1000;
let streamState = "closed";

function broadcast(message) {
  for (const port of ports) port.postMessage(message);
}

function setState(state) {
  streamState = state;
  broadcast({kind: "stream", state});
}

function open() {
  clearTimeout(retry);
  retry = null;
  setState("connecting");
  stop = readStream("/ui/stream", secret ? {[HEADER]: secret} : {}, {
    onOpen: () => { retryMs = 1000; setState("open"); },
    onEvent: (type, data) => {
      if (type === "host") {
        const view = JSON.parse(data);
        views.set(view.id, view);
        broadcast({kind: "host", view});
      } else if (type === "signal") {
        const signal = JSON.parse(data);
        signals.push(signal);
        if (signals.length > KEPT_SIGNALS) signals.shift();
        broadcast({kind: "signal", signal});
      }
    },
    // Whatever ended it (the network, a server restart, 401 once the session is gone, 503 past the hub's
    // subscriber limit): try again, backing off, up to a minute apart.
    onClose: () => {
      stop = null;
      setState("closed");
      retry = setTimeout(open, retryMs);
      retryMs = Math.min(retryMs * 2, 60000);
    },
  });
}

self.addEventListener("connect", (e) => {
  const port = e.ports[0];
  ports.add(port);
  port.addEventListener("message", (m) => {
    if (m.data === "bye") ports.delete(port); // the tab is going away
    else if (m.data && m.data.kind === "session" && m.data.secret !== secret) {
      secret = m.data.secret; // a new login: the stream goes on with it
      if (stop) stop(); // (its onClose schedules the next try)
      open();
    }
  });
  port.start();
  port.postMessage({kind: "stream", state: streamState});
  for (const view of views.values()) port.postMessage({kind: "host", view});
  for (const signal of signals) port.postMessage({kind: "signal", signal});
  if (stop === null && retry === null) open(); // at once, not at the next try
});
