"""Whose uid it is: a subordinate uid (/etc/subuid) belongs to the person who owns its range.

shadow's useradd gives each local account a range of subordinate uids (65,536 on Debian), and newuidmap lets the
account map them into a user namespace of its own. From there it calls the bus as any of those uids, and the bus
reports each one as itself (GetConnectionCredentials gives the uid as the bus's namespace sees it). A limit kept
per uid would be a limit per 65,537 uids for that person. (dbus-daemon lets a uid connect only if NSS knows it,
which subordinate uids need an entry for; dbus-broker, Fedora's and Arch's bus, asks nothing of the kind.)
gpukilld keeps its limits (call rate, polkit checks, policy tests, refusals folded in the journal) per person
instead: person(uid) is the owner's uid for a subordinate uid, the uid itself otherwise.

- The file is root's. It is read once at start, then again when it changed (stat checked at most once per
  RECHECK seconds), in a thread of its own, as an owner named by name is resolved through NSS (getpwnam), which
  may be a directory server; the previous table serves meanwhile. The parse is bounded: MAX_BYTES of the file,
  MAX_RANGES ranges; lines that are not NAME_OR_UID:START:COUNT are skipped.
- An owner is its own person, even where its uid lies in someone else's range: an account is a person.
- A range owned by root (LXD slices one among its containers) is not charged to root, who is not limited: the
  whole range is one person of its own, named by its first uid.
- Overlapping ranges (useradd never writes them) give the overlap to the range that starts first.
- Subordinate uids handed out by NSS (`subid:` in nsswitch.conf, shadow's libsubid) are not seen: only the file.
- /etc/subgid is not read: no limit counts groups.
"""

from __future__ import annotations

import bisect
import logging
import os
import pwd
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

SUBUID = "/etc/subuid"
RECHECK = 1.0  # seconds between two stat()s of the file
MAX_BYTES = 4 << 20  # of the file read; ~25 bytes a line: ~160,000 accounts
MAX_RANGES = 65536
UID_LIMIT = 1 << 32  # uids are 32-bit; (uid_t)-1 is no uid


@dataclass(frozen=True, slots=True)
class Range:
    start: int
    end: int  # one past the last subordinate uid
    owner: int  # the owner's uid


def _uid_of(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except (KeyError, UnicodeError, ValueError):
        return None


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else None


def parse_subuid(text: str, resolve: Callable[[str], int | None] = _uid_of) -> list[Range]:
    """The ranges of subuid(5) text, at most MAX_RANGES, each owner resolved to its uid (a name NSS does not know
    is skipped), disjoint and sorted by start."""
    found: list[Range] = []
    names: dict[str, int | None] = {}  # an owner with several ranges is resolved once
    for line in text.splitlines():
        if len(found) >= MAX_RANGES:
            log.warning("%s has more than %d ranges; the rest are not charged to their owners", SUBUID, MAX_RANGES)
            break
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) != 3:
            continue
        name, start, count = parts[0], _number(parts[1]), _number(parts[2])
        if not name or start is None or not count or start + count > UID_LIMIT - 1:
            continue
        owner = _number(name)
        if owner is None:
            if name not in names:
                names[name] = resolve(name)
            owner = names[name]
        if owner is None or owner >= UID_LIMIT - 1:
            continue
        found.append(Range(start, start + count, owner))
    found.sort(key=lambda r: (r.start, r.end))
    ranges: list[Range] = []
    for r in found:
        start = max(r.start, ranges[-1].end) if ranges else r.start
        if start < r.end:
            ranges.append(Range(start, r.end, r.owner))
    return ranges


class Table:
    """Ranges as read at one time, and the persons they make."""

    def __init__(self, ranges: list[Range]) -> None:
        self.ranges = ranges
        self._starts = [r.start for r in ranges]
        self._owners = frozenset(r.owner for r in ranges)

    def range_of(self, uid: int) -> Range | None:
        i = bisect.bisect_right(self._starts, uid) - 1
        if i >= 0 and uid < self.ranges[i].end:
            return self.ranges[i]
        return None

    def person(self, uid: int) -> int:
        if uid == 0 or uid in self._owners:
            return uid
        r = self.range_of(uid)
        if r is None:
            return uid
        return r.owner if r.owner != 0 else r.start

    def charged(self, uid: int) -> str:
        """Whom a uid's calls are charged to, as messages name it."""
        if uid == 0:
            return "uid 0"
        if uid in self._owners:
            return f"uid {uid} (with its subordinate uids)"
        r = self.range_of(uid)
        if r is None:
            return f"uid {uid}"
        if r.owner == 0:
            return f"root's subordinate uids {r.start}-{r.end - 1}"
        return f"uid {r.owner} (with its subordinate uids, {uid} among them)"


class People:
    """person(uid) from the current /etc/subuid (see the module's docstring)."""

    def __init__(
        self,
        path: str = SUBUID,
        clock: Callable[[], float] = time.monotonic,
        resolve: Callable[[str], int | None] = _uid_of,
    ) -> None:
        self.path = path
        self._clock = clock
        self._resolve = resolve
        self._table = Table([])
        self._read_as: tuple[int, ...] | None = None  # the file's identity when the table was read
        self._checked = clock()
        self._reading = False
        self._lock = threading.Lock()
        self.refresh()

    def person(self, uid: int) -> int:
        """The uid every limit charges uid's calls to: its owner's for a subordinate uid, else uid itself."""
        self._maybe_reload()
        return self._table.person(uid)

    def charged(self, uid: int) -> str:
        self._maybe_reload()
        return self._table.charged(uid)

    @property
    def ranges(self) -> list[Range]:
        return self._table.ranges

    def refresh(self) -> None:
        """Read the file now, in the calling thread, if it changed since the last read."""
        identity = self._identity()
        if identity != self._read_as:
            self._load(identity)

    def _identity(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked < RECHECK or self._reading:
            return
        self._checked = now
        identity = self._identity()
        if identity == self._read_as:
            return
        self._reading = True
        threading.Thread(target=self._load, args=(identity,), name="gpukilld-subuid", daemon=True).start()

    def _load(self, identity: tuple[int, ...] | None) -> None:
        """Read and parse the file (stat'ed as identity just before: a change after that is seen next time)."""
        try:
            text = ""
            if identity is not None:
                try:
                    with open(self.path, "rb") as f:
                        data = f.read(MAX_BYTES + 1)
                except OSError as e:
                    log.warning("cannot read %s: %s; uids are charged each to itself", self.path, e)
                    data = b""
                if len(data) > MAX_BYTES:
                    log.warning(
                        "%s is larger than %d bytes; ranges past that are not charged to their owners",
                        self.path,
                        MAX_BYTES,
                    )
                    data = data[: data.rfind(b"\n", 0, MAX_BYTES) + 1]
                text = data.decode("utf-8", errors="replace")
            table = Table(parse_subuid(text, self._resolve))
            with self._lock:
                self._table, self._read_as = table, identity
        except Exception:  # a thread must not die unseen; the old table stays in force
            log.exception("reading %s failed", self.path)
        finally:
            self._reading = False


_shared: People | None = None
_shared_lock = threading.Lock()


def shared() -> People:
    """The daemon's one reader of /etc/subuid, for everything that keeps a limit per person."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = People()
        return _shared
