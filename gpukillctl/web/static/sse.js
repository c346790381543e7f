// A text/event-stream read through fetch, which, unlike EventSource, sends the session's header
// (session.js). Calls onOpen() once the server answered 200, onEvent(type, data) for each event,
// onClose(status) when the stream ends for any reason (status 0: the network), after which nothing more
// is called. The caller reconnects. Returns a function that closes it.

export function readStream(url, headers, {onOpen, onEvent, onClose}) {
  const abort = new AbortController();
  let closed = false;
  const close = (status) => {
    if (closed) return;
    closed = true;
    onClose(status);
  };
  (async () => {
    let response;
    try {
      response = await fetch(url, {headers: {Accept: "text/event-stream", ...headers}, signal: abort.signal,
        credentials: "same-origin", cache: "no-store"});
    } catch {
      close(0);
      return;
    }
    if (!response.ok || !response.body) {
      close(response.status);
      return;
    }
    onOpen();
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let type = "";
    let data = [];
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += value;
        const lines = buffer.split(/\r\n|\r|\n/);
        buffer = lines.pop();
        for (const line of lines) {
          if (line === "") {
            if (data.length && !closed) onEvent(type || "message", data.join("\n"));
            type = "";
            data = [];
          } else if (!line.startsWith(":")) {
            const colon = line.indexOf(":");
            const field = colon < 0 ? line : line.slice(0, colon);
            const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
            if (field === "event") type = text;
            else if (field === "data") data.push(text);
          }
        }
      }
      close(200);
    } catch {
      close(0);
    }
  })();
  return () => {
    abort.abort();
    close(0);
  };
}
