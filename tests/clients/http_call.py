"""Make one HTTP request to a local server and print the outcome as JSON (run as any user by tests).

Standard input: a JSON object {port or unix, method, path, headers, body}: port, a TCP port on 127.0.0.1;
unix, the path of a Unix socket (then Host: localhost); body is a JSON value or null. Output:
{"status", "headers", "body"}, body parsed as JSON where it is JSON. Standard library only.
"""

import http.client
import json
import socket
import sys


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def main() -> None:
    spec = json.load(sys.stdin)
    if spec.get("unix"):
        conn = UnixHTTPConnection(spec["unix"])
    else:
        conn = http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=60)
    body = None if spec.get("body") is None else json.dumps(spec["body"]).encode()
    headers = dict(spec.get("headers") or {})
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    conn.request(spec.get("method", "GET"), spec["path"], body=body, headers=headers)
    response = conn.getresponse()
    raw = response.read()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    json.dump(
        {"status": response.status, "headers": {k.lower(): v for k, v in response.getheaders()}, "body": parsed},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
