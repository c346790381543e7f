// One EventSource on /ui/stream for every tab of this browser (a SharedWorker): 32 open tabs are one
// subscriber of the hub, not 32. Each tab connects a port; it gets the newest view of every host at once
// (the hub sent those when this stream opened), the signals kept so far, then every event as it comes.
// Messages to a tab: {kind: "host", view}, {kind: "signal", signal}, {kind: "stream", state: "open"|"closed"}.

const KEPT_SIGNALS = 500; // as many as the events page shows
const views = new Map(); // host id → its newest HostView
const signals = []; // oldest first
const ports = new Set();
let source = null;
let retry = null; // the timer of the next try after a refusal
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
  source = new EventSource("/ui/stream");
  source.addEventListener("open", () => { retryMs = 1000; setState("open"); });
  source.addEventListener("host", (e) => {
    const view = JSON.parse(e.data);
    views.set(view.id, view);
    broadcast({kind: "host", view});
  });
  source.addEventListener("signal", (e) => {
    const signal = JSON.parse(e.data);
    signals.push(signal);
    if (signals.length > KEPT_SIGNALS) signals.shift();
    broadcast({kind: "signal", signal});
  });
  source.addEventListener("error", () => {
    // A network error: EventSource retries by itself. A refusal (401 once the session is gone, 503 past the
    // hub's subscriber limit) closes it for good: try again, backing off, up to a minute apart.
    if (source.readyState === EventSource.CLOSED) {
      source = null;
      setState("closed");
      retry = setTimeout(open, retryMs);
      retryMs = Math.min(retryMs * 2, 60000);
    } else {
      setState("connecting");
    }
  });
}

self.addEventListener("connect", (e) => {
  const port = e.ports[0];
  ports.add(port);
  port.addEventListener("message", (m) => {
    if (m.data === "bye") ports.delete(port); // the tab is going away
  });
  port.start();
  port.postMessage({kind: "stream", state: streamState});
  for (const view of views.values()) port.postMessage({kind: "host", view});
  for (const signal of signals) port.postMessage({kind: "signal", signal});
  if (source === null) open(); // at once, not at the next try: a new tab may come with a new login
});
