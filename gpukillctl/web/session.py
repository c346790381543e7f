"""The dashboard's logins: one-time codes (the link `gpukillctl serve` prints or opens) and the session secrets
a browser holds in its cookie once it used one.

A code is what travels in a URL (the terminal, the browser's history, a process list while the browser starts),
so it is good once and for a few minutes; the secret it is exchanged for lives only in an HttpOnly cookie. Both
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

CODE_SECONDS = 600.0  # a one-time link is good for 10 minutes
MAX_CODES = 8
MAX_SESSIONS = 64
COOKIE = "gpukill-session"  # on TCP with the port: cookies are not scoped by port, two servers' would clash


def cookie_name(port: int | None) -> str:
    """The session cookie's name: `gpukill-session-PORT` on TCP, `gpukill-session` on the socket."""
    return COOKIE if port is None else f"{COOKIE}-{port}"


class Sessions:
    """The codes not yet used and the sessions they opened, for one server's life (nothing is written down: a
    restart logs every browser out, as it changes the token)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.codes: OrderedDict[str, float] = OrderedDict()  # code -> when it expires, oldest first
        self.secrets: OrderedDict[str, None] = OrderedDict()  # session secrets, oldest first

    def new_code(self) -> str:
        """A fresh one-time code, good for CODE_SECONDS; past MAX_CODES the oldest is forgotten."""
        code = secrets.token_urlsafe(32)
        self.codes[code] = self.clock() + CODE_SECONDS
        while len(self.codes) > MAX_CODES:
            self.codes.popitem(last=False)
        return code

    def redeem(self, code: str) -> str | None:
        """A new session's secret for a valid code, which is then used up; None for any other text."""
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
        secret = secrets.token_urlsafe(32)
        self.secrets[secret] = None
        while len(self.secrets) > MAX_SESSIONS:
            self.secrets.popitem(last=False)
        return secret

    def valid(self, secret: str | None) -> bool:
        """Whether a cookie's value is the secret of a live session (every one compared, in constant time)."""
        if not secret:
            return False
        given = secret.encode("utf-8", "replace")
        return any([hmac.compare_digest(known.encode(), given) for known in self.secrets])
