// The live feed for this tab: through the SharedWorker (stream-worker.js: one stream for the whole
// browser), or, where SharedWorker is missing, a stream of this tab's own. Live data comes only from
// here: the page never polls /v1/processes.

import {headers, secret} from "./session.js";
import {readStream} from "./sse.js";

export function subscribe(onMessage) {
  if (typeof SharedWorker === "function") {
    const worker = new SharedWorker("/static/stream-worker.js", {name: "gpukill-stream", type: "module"});
    worker.port.addEventListener("message", (e) => onMessage(e.data));
    worker.port.start();
    worker.port.postMessage({kind: "session", secret: secret()});
    addEventListener("pagehide", () => worker.port.postMessage("bye"));
    return;
  }
  let retryMs = 1000;
  const open = () => readStream("/ui/stream", headers(), {
    onOpen: () => { retryMs = 1000; onMessage({kind: "stream", state: "open"}); },
    onEvent: (type, data) => {
      if (type === "host") onMessage({kind: "host", view: JSON.parse(data)});
      else if (type === "signal") onMessage({kind: "signal", signal: JSON.parse(data)});
    },
    onClose: () => {
      onMessage({kind: "stream", state: "connecting"});
      setTimeout(open, retryMs);
      retryMs = Math.min(retryMs * 2, 60000);
    },
  });
  open();
}
