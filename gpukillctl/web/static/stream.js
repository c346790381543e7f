// The live feed for this tab: through the SharedWorker (stream-worker.js: one EventSource for the whole
// browser), or, where SharedWorker is missing, an EventSource of this tab's own. Live data comes only from
// here: the page never polls /v1/processes.

export function subscribe(onMessage) {
  if (typeof SharedWorker === "function") {
    const worker = new SharedWorker("/static/stream-worker.js", {name: "gpukill-stream"});
    worker.port.addEventListener("message", (e) => onMessage(e.data));
    worker.port.start();
    addEventListener("pagehide", () => worker.port.postMessage("bye"));
    return;
  }
  const source = new EventSource("/ui/stream");
  source.addEventListener("open", () => onMessage({kind: "stream", state: "open"}));
  source.addEventListener("error", () => onMessage({kind: "stream", state: "connecting"}));
  source.addEventListener("host", (e) => onMessage({kind: "host", view: JSON.parse(e.data)}));
  source.addEventListener("signal", (e) => onMessage({kind: "signal", signal: JSON.parse(e.data)}));
}
