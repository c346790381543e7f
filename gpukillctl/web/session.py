"""The dashboard's logins: one-time codes (the link `gpukillctl serve` prints or opens) and the two halves of
the session a browser holds once it used one.

A code is what travels in a URL (the terminal, the browser's history, a process list while the browser starts),
so it is good once and for a few minutes. It is exchanged for a session of two secrets:
- the cookie's (HttpOnly): a browser sends it to every port of the host, since cookies are scoped by host and
  SameSite compares sites, not ports. A page that another local user serves on 127.0.0.1:OTHER receives it;
  alone it opens the page's own files (which hold no data), nothing else;
- the page's: handed to the page once, in the fragment of the login's redirect (a fragment never leaves the
  browser), kept in the origin's localStorage (scheme, host and port: no page of another port reads it) and
  sent by the page's script as a header (gpukillctl/http/gate.py's PAGE_HEADER) on every request for data or action.
A request counts as the session's only with both halves of the same session. Both
are bounded, so that nobody holding the token can make the server keep more and more of them: at most
MAX_CODES codes outstanding (the oldest dropped), at most MAX_SESSIONS sessions (the oldest dropped: that
browser logs in again). Every comparison takes the same time whatever the first differing byte
(hmac.compare_digest), as the token's does.

Pure and standard library only: the gate (gpukillctl/http/gate.py) asks it, and its tests need no server.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

CODE_SECONDS = 600.0  # a one-time link is good for 10 minutes
MAX_CODES = 8
MAX_SESSIONS = 64
COOKIE = "gpukill-session"  # on TCP with the port: cookies are not scoped by port, two servers' would clash


def cookie_name(port: int | None) -> str:
    """The session cookie's name: `gpukill-session-PORT` on TCP, `gpukill-session` on the socket."""
    return COOKIE if port is None else f"{COOKIE}-{port}"


@dataclass(frozen=True, slots=True)
class Login:
    """A session's two secrets: the cookie's and the page's."""

    cookie: str
    page: str


class Sessions:
    """The codes not yet used and the sessions they opened, for one server's life (nothing is written down: a
    restart logs every browser out, as it changes the token)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.codes: OrderedDict[str, float] = OrderedDict()  # code -> when it expires, oldest first
        self.secrets: OrderedDict[str, str] = OrderedDict()  # cookie secret -> page secret, oldest first

    def new_code(self) -> str:
        """A fresh one-time code, good for CODE_SECONDS; past MAX_CODES the oldest is forgotten."""
        code = secrets.token_urlsafe(32)
        self.codes[code] = self.clock() + CODE_SECONDS
        while len(self.codes) > MAX_CODES:
            self.codes.popitem(last=False)
        return code

    def redeem(self, code: str) -> Login | None:
        """A new session for a valid code, which is then used up; None for any other text."""
        now = self.clock()
        found = None
        for known, expires in list(self.codes.items()):
            if expires <= now:
                del self.codes[known]
            elif hmac.compare_digest(known.encode(), code.encode("utf-8", "replace")):
                found = known
        if found is None:
            return None
        del self.codes[found]
        login = Login(secrets.token_urlsafe(32), secrets.token_urlsafe(32))
        self.secrets[login.cookie] = login.page
        while len(self.secrets) > MAX_SESSIONS:
            self.secrets.popitem(last=False)
        return login

    def valid(self, cookie: str | None, page: str | None = None, *, page_files: bool = False) -> bool:
        """Whether a cookie's value and the page's header are the two halves of one live session; page_files:
        the cookie alone, which opens the page's own files only. Every session is compared, in constant time."""
        if not cookie or (not page and not page_files):
            return False
        given = cookie.encode("utf-8", "replace")
        given_page = (page or "").encode("utf-8", "replace")
        return any(
            [
                hmac.compare_digest(known.encode(), given)
                & (page_files | hmac.compare_digest(half.encode(), given_page))
                for known, half in self.secrets.items()
            ]
        )
