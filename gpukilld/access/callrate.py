"""How often each person may call gpukilld.

Every call is answered on one main loop, in the order dbus-daemon delivers them: a user who sends calls as
fast as the bus takes them would queue everyone else's behind their own. Each person (a uid and its subordinate
uids: the Door charges a call to people.People.person of its uid, so that 65,536 subordinate uids are not 65,536
buckets) has a token bucket of BURST calls refilled at RATE a second; a call beyond it is answered at once with a
small TooBusy error, which costs neither the daemon nor dbus-daemon what a listing does. Root is not limited (the
benchmarks and the admin's own tools run as root).
"""

from __future__ import annotations

import time
from collections.abc import Callable

RATE = 200.0  # calls a second, per person: a `top` or an exporter needs a few
BURST = 400.0
# The listings every user may ask that change only when an admin changes something (Guard's managed
# policies): a few a second is more than any front end needs, and each is a whole directory's worth of reply.
LISTING_RATE = 5.0
LISTING_BURST = 20.0


class CallRate:
    def __init__(self, clock: Callable[[], float] = time.monotonic, rate: float = RATE, burst: float = BURST) -> None:
        self._clock = clock
        self.rate, self.burst = rate, burst
        self._buckets: dict[int, tuple[float, float]] = {}  # person -> (tokens, when)

    def allow(self, uid: int) -> bool:
        """Whether a call charged to uid (a person, as people.py names it) may be answered now."""
        if uid == 0:
            return True
        now = self._clock()
        tokens, when = self._buckets.get(uid, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        if tokens < 1.0:
            self._buckets[uid] = (tokens, now)
            return False
        if len(self._buckets) > 65536:  # bounded whatever happens: forgetting means a full bucket
            self._buckets.clear()
        self._buckets[uid] = (tokens - 1.0, now)
        return True

    def charge(self, uid: int, calls: int) -> None:
        """Count calls that were answered before their uid was known against its person: the bucket may go
        below zero, and the person is refused until it has refilled past the debt."""
        if uid == 0 or calls <= 0:
            return
        now = self._clock()
        tokens, when = self._buckets.get(uid, (self.burst, now))
        self._buckets[uid] = (min(self.burst, tokens + (now - when) * self.rate) - calls, now)
