"""Flood a local HTTP server as slowly and as widely as one user can, or probe it as its owner, and print what
happened as JSON (run as any user by tests). Standard library only.

Standard input: a JSON object {mode, port, seconds, ...}:
- mode "flood": for `seconds`, keep up to `sockets` connections to 127.0.0.1:port open, each, in turn, one of
  `kinds`: "slowloris" (a request's headers, then one byte of a header value at a time), "chunked" (a POST
  with a wrong token and Transfer-Encoding: chunked, then a one-byte chunk at a time), "silent" (connected,
  nothing sent). A connection the server closes is replaced at once, so the server sees new connections as
  fast as it closes old ones. Output: {"opened", "answered", "closed_by_server", "peak_open"}.
- mode "probe": for `seconds`, GET `path` with `Authorization: Bearer token` every `interval` seconds, each on
  a new connection, each given `timeout` seconds. Output: {"results": [[status or error, seconds, seconds to connect or
  null], ...]}.
"""

import http.client
import json
import resource
import selectors
import socket
import sys
import time

TRICKLE_EVERY = 0.5  # seconds between the bytes of one slow connection


def flood(spec: dict) -> dict:
    port, seconds, kinds = spec["port"], spec["seconds"], spec["kinds"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    limit = min(spec["sockets"], hard - 32)
    host = f"127.0.0.1:{port}"
    openers = {
        "slowloris": f"GET /v1/devices HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode(),
        "chunked": (
            f"POST /v1/guard/test HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {'w' * 43}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode(),
        "silent": b"",
    }
    drips = {"slowloris": b"a", "chunked": b"1\r\nx\r\n", "silent": b""}
    sel = selectors.DefaultSelector()
    state: dict[socket.socket, list] = {}  # sock: [kind, connected, last send]
    counts = {"opened": 0, "answered": 0, "closed_by_server": 0, "peak_open": 0}
    turn = 0

    def open_one() -> None:
        nonlocal turn
        kind = kinds[turn % len(kinds)]
        turn += 1
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect_ex(("127.0.0.1", port))
        except OSError:
            s.close()
            return
        state[s] = [kind, False, 0.0]
        sel.register(s, selectors.EVENT_WRITE)
        counts["opened"] += 1

    def drop(s: socket.socket, by_server: bool) -> None:
        sel.unregister(s)
        del state[s]
        s.close()
        counts["closed_by_server"] += int(by_server)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while len(state) < limit:
            open_one()
        counts["peak_open"] = max(counts["peak_open"], len(state))
        for key, _ in sel.select(0.05):
            s = key.fileobj
            kind, connected, _ = state[s]
            if not connected:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    drop(s, True)
                    continue
                try:
                    s.send(openers[kind])
                except OSError:
                    drop(s, True)
                    continue
                state[s][1:] = [True, time.monotonic()]
                sel.modify(s, selectors.EVENT_READ)
                continue
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                drop(s, True)
            else:  # answered (a 401 before the body): it goes on trickling until the server closes it
                counts["answered"] += 1
        now = time.monotonic()
        for s, (kind, connected, last) in list(state.items()):
            if connected and drips[kind] and now - last >= TRICKLE_EVERY:
                try:
                    s.send(drips[kind])
                    state[s][2] = now
                except OSError:
                    drop(s, True)
    for s in list(state):
        drop(s, False)
    return counts


def probe(spec: dict) -> dict:
    results = []
    end = time.monotonic() + spec["seconds"]
    while time.monotonic() < end:
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=spec["timeout"])
        connected = None
        try:
            conn.connect()
            connected = round(time.monotonic() - started, 3)
            conn.request("GET", spec["path"], headers={"Authorization": f"Bearer {spec['token']}"})
            response = conn.getresponse()
            response.read()
            outcome: object = response.status
        except (OSError, http.client.HTTPException) as e:
            outcome = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        results.append([outcome, round(time.monotonic() - started, 3), connected])
        time.sleep(max(0.0, spec["interval"] - (time.monotonic() - started)))
    return {"results": results}


def main() -> None:
    spec = json.load(sys.stdin)
    json.dump(flood(spec) if spec["mode"] == "flood" else probe(spec), sys.stdout)


if __name__ == "__main__":
    main()
