"""Servers on loopback that guard notifications are sent to: an SMTP relay (aiosmtpd, from the test extra), a
webhook receiver (http.server) and a relay that accepts connections and never answers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mailbox:
    """aiosmtpd handler: keeps what a real relay would accept; with refuse (an SMTP reply such as "554 5.7.1
    no"), answers every message's DATA with it and keeps nothing (refused counts the attempts)."""

    def __init__(self, refuse: str = "", unknown: tuple[str, ...] = ()) -> None:
        self.messages: list[tuple[str, list[str], bytes]] = []
        self.refuse = refuse
        self.refused = 0
        self.unknown = unknown  # recipients refused at RCPT with 550, as a relay refuses a mailbox it lacks
        self.cond = threading.Condition()

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):  # noqa: N802 - its hook
        if address in self.unknown:
            return "550 5.1.1 no such mailbox"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        with self.cond:
            if self.refuse:
                self.refused += 1
                return self.refuse
            self.messages.append((envelope.mail_from, list(envelope.rcpt_tos), envelope.content))
            self.cond.notify_all()
        return "250 Message accepted for delivery"

    def wait(self, count: int, timeout: float = 15.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.messages) >= count, timeout)


class Hooks:
    def __init__(self, status: int = 200) -> None:
        self.posts: list[tuple[str, dict, str]] = []
        self.status = status
        self.cond = threading.Condition()
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's hook name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with hooks.cond:
                    hooks.posts.append((self.path, json.loads(body), self.headers["Content-Type"]))
                    hooks.cond.notify_all()
                self.send_response(hooks.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float = 15.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.posts) >= count, timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Blackhole:
    """Accepts TCP connections (the kernel completes them from the backlog) and never says a word."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def smtp_relay(refuse: str = "", unknown: tuple[str, ...] = ()) -> Iterator[tuple[Mailbox, int]]:
    """A real SMTP server on a free loopback port delivering into a Mailbox: (mailbox, port); refuse and
    unknown as Mailbox takes them."""
    from aiosmtpd.controller import Controller  # the test extra; callers importorskip it first

    box = Mailbox(refuse, unknown)
    port = free_port()
    controller = Controller(box, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield box, port
    finally:
        controller.stop()
