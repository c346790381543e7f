"""Notifications, delivered off the enforcement path.

send() never blocks: e-mail and webhook deliveries go into bounded queues, each drained by its own thread
with a timeout per attempt and a few retries, so a slow or dead SMTP relay never delays a kill (nor holds up
webhooks). A full queue drops the new notice and counts it; a notice that still fails after its retries is
reported through on_failure (the audit trail). `journal` and `desktop` are handled at once by the caller's
callbacks: a journal entry and the Notification D-Bus signal. `owner` fans out to the subject's owner: their
terminals (owner_tty, in a channel thread of its own, one attempt, never blocking), their mail at owner_mail's
address (a queue of its own) and the desktop signal; each outcome goes to `warned` for the audit trail.

Each channel counts what became of each notice, once: delivered (written to a terminal, accepted by the mail
server: its 250 after DATA, or a 2xx from the webhook), skipped (nothing to deliver to: no login session with a
terminal, every terminal mesg n or not the owner's, no plain address), failed (a write error, a timeout, a
refusal, after the retries) or dropped (its queue full). The desktop channel only announces: the Notification
signal goes to whichever agent listens, and none answers whether it showed it.

The threads are daemon threads: gpukilld's exit never waits for a relay that does not answer.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import pwd
import queue
import re
import smtplib
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from typing import Any

from gpukill.text import shown
from gpukilld.guard import owner_tty

log = logging.getLogger(__name__)

QUEUE_SIZE = 256
PER_OWNER = 16  # an owner's notices waiting in the tty and owner-mail channels: past it, only theirs are dropped
RETRIES = 3  # attempts per notice
BACKOFF = 2.0  # seconds before the 2nd attempt, doubling after that


@dataclass(frozen=True, slots=True)
class NotifyConfig:
    smtp_host: str = "localhost"
    smtp_port: int = 25
    mail_from: str = ""  # "" means gpukilld@HOSTNAME
    timeout: float = 10.0  # per attempt: connect, each SMTP reply, the HTTP response
    retries: int = RETRIES
    backoff: float = BACKOFF
    queue_size: int = QUEUE_SIZE
    owner_mail: str = ""  # gpukilld.conf [notify] owner_mail: "{user}@example.org"; "": no mail to owners
    owner_mesg: bool = True  # respect a terminal's mesg n
    utmp: str = owner_tty.UTMP
    logind_bus: str | None = "SYSTEM"  # where logind answers (a jeepney bus name or address); None: utmp only


_ADDRESS = re.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,190}|[A-Za-z0-9._-]{1,64}")
OWNER = "owner"


def owner_address(template: str, uid: int) -> str | None:
    """The owner's address from the template ({user}, {uid}); None when it is not a plain address. A user name is
    bounded by the system, yet checked here too: it must not add a second recipient or a header."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
    address = template.replace("{user}", user).replace("{uid}", str(uid))
    return address if _ADDRESS.fullmatch(address) else None


@dataclass(frozen=True, slots=True)
class Notice:
    event: str  # violation, action
    rule: str
    subject: str
    summary: str  # one line: the e-mail subject, the desktop title
    body: str  # a few lines for people
    data: dict[str, Any] = field(default_factory=dict)  # the webhook's JSON object


DELIVERED, SKIPPED, FAILED = "delivered", "skipped", "failed"  # what a transport returns for a notice


@dataclass(slots=True)
class ChannelStats:
    queued: int = 0
    delivered: int = 0
    skipped: int = 0
    failed: int = 0
    dropped: int = 0
    announced: int = 0  # desktop only: signalled on the bus
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, outcome: str) -> None:
        """One more notice of the outcome (a field's name); from any thread."""
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)


class FairQueue(queue.Queue):
    """A queue of (owner, notice) served one owner after the other, each owner's own in order, at most per_owner
    of them waiting (queue.Full past it, as past maxsize): one owner's flood of warnings fills only their own
    lane, and every other owner's next warning is at most one of theirs behind. queue.Queue's locking, waits and
    task counting are kept: only its storage (_init, _qsize, _put, _get) is ours."""

    def __init__(self, maxsize: int, per_owner: int) -> None:
        self.per_owner = per_owner
        super().__init__(maxsize)

    def _init(self, maxsize: int) -> None:
        self.lanes: dict[Any, collections.deque] = {}  # owner -> its items; dict order: whose turn is next
        self.items = 0

    def _qsize(self) -> int:
        return self.items

    def _put(self, item: Any) -> None:
        self.lanes.setdefault(None if item is None else item[0], collections.deque()).append(item)
        self.items += 1

    def _get(self) -> Any:
        owner = next(iter(self.lanes))
        lane = self.lanes.pop(owner)
        item = lane.popleft()
        if lane:
            self.lanes[owner] = lane  # to the back: the other owners go first
        self.items -= 1
        return item

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if item is not None:
            with self.mutex:
                lane = self.lanes.get(item[0])
                if lane is not None and len(lane) >= self.per_owner:
                    raise queue.Full
        super().put(item, block=False)  # the channels never wait to queue: a full queue drops


class _Channel:
    """One transport: a bounded queue and the thread that drains it. The thread sleeps in the queue until a
    notice or close() comes: a daemon with four channels must not wake four times a second to find nothing
    (bench/idle_cost measured that at 0.06 % of a core)."""

    _WAKE = None  # what close() puts in the queue to end the thread's wait

    def __init__(
        self,
        name: str,
        deliver: Callable[[Any, Notice], str],
        config: NotifyConfig,
        on_failure: Callable[[str, Notice, str], None],
        stop: threading.Event,
        per_owner: int = 0,
    ) -> None:
        """per_owner: the targets are owners (a uid, an address), served fairly (FairQueue), at most this many
        of one owner's notices waiting."""
        self.name = name
        self.deliver = deliver
        self.config = config
        self.on_failure = on_failure
        self.stop = stop
        self.queue: queue.Queue[tuple[Any, Notice] | None] = (
            FairQueue(config.queue_size, per_owner) if per_owner else queue.Queue(config.queue_size)
        )
        self.stats = ChannelStats()
        self.thread = threading.Thread(target=self._run, name=f"notify-{name}", daemon=True)
        self.thread.start()

    def put(self, target: Any, notice: Notice) -> None:
        try:
            self.queue.put_nowait((target, notice))
            self.stats.count("queued")
        except queue.Full:
            self.stats.count("dropped")
            full = (
                f"{PER_OWNER} notices of this owner are waiting"
                if isinstance(self.queue, FairQueue) and self.queue.qsize() < self.config.queue_size
                else f"the queue is full ({self.config.queue_size})"
            )
            self.on_failure(str(target), notice, f"the {self.name} channel: {full}; notice dropped")

    def wake(self) -> None:
        """End the thread's wait (after stop is set). A full queue needs none: the thread is not waiting, and
        looks at stop after the notice it is delivering."""
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(self._WAKE)

    def wait_idle(self, timeout: float) -> bool:
        """True once every notice put has been delivered or given up."""
        q = self.queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def _run(self) -> None:
        while not self.stop.is_set():
            item = self.queue.get()
            try:
                if item is not self._WAKE:
                    self._deliver(*item)
            finally:
                self.queue.task_done()

    def _deliver(self, target: Any, notice: Notice) -> None:
        """deliver() returns DELIVERED, SKIPPED or FAILED (a failure it has reported itself); an exception is
        retried, then reported through on_failure."""
        error = ""
        outcome = FAILED
        delay = self.config.backoff
        for attempt in range(1, self.config.retries + 1):
            try:
                outcome = self.deliver(target, notice)
                error = ""
                break
            except Exception as e:  # any failure of a relay or endpoint: retry, then report
                error = _one_line(e)
                log.warning(
                    "%s delivery to %s failed (attempt %d of %d): %s",
                    self.name,
                    target,
                    attempt,
                    self.config.retries,
                    error,
                )
                if attempt < self.config.retries and self.stop.wait(delay):
                    break
                delay *= 2
        if error:
            self.stats.count(FAILED)
            self.on_failure(str(target), notice, error)
        else:
            self.stats.count(outcome)


def _one_line(e: BaseException) -> str:
    text = str(e).replace("\n", " ").strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Notifier:
    def __init__(
        self,
        config: NotifyConfig,
        on_failure: Callable[[str, Notice, str], None],
        journal: Callable[[Notice], None],
        desktop: Callable[[Notice], None],
        warned: Callable[[str, str, Notice, str, str], None] | None = None,
    ) -> None:
        """warned(channel, target, notice, outcome, detail): each delivery to an owner, for the audit trail;
        called from the channel threads."""
        self.config = config
        self._warned = warned or (lambda *_: None)
        self._journal = journal
        self._desktop = desktop
        self._stop = threading.Event()
        self.mail = _Channel("e-mail", self._send_mail, config, on_failure, self._stop)
        self.webhook = _Channel("webhook", self._post, config, on_failure, self._stop)
        owner_failed = lambda target, notice, error: self._warned("mail", target, notice, "failed", error)  # noqa: E731
        self.owner_mail = _Channel(
            "owner-mail", self._send_owner_mail, config, owner_failed, self._stop, per_owner=PER_OWNER
        )
        tty_config = NotifyConfig(retries=1, queue_size=config.queue_size)  # a terminal is written once or not
        self.tty = _Channel(
            "tty",
            self._write_ttys,
            tty_config,
            lambda t, n, e: self._warned("tty", t, n, "failed", e),
            self._stop,
            per_owner=PER_OWNER,
        )
        self.desktop = ChannelStats()  # announced only: the signal goes out, no agent answers

    def keep_counts(self, old: Notifier) -> None:
        """Count on in old's counters (a notifier replaced after a reload): the counts are since gpukilld
        started, and a notice old still delivers is counted where the new ones are."""
        for mine, theirs in zip(self._channels(), old._channels(), strict=True):
            mine.stats = theirs.stats
        self.desktop = old.desktop

    def _announce(self, notice: Notice) -> None:
        self._desktop(notice)
        self.desktop.count("announced")

    def send(self, targets: tuple[str, ...], notice: Notice) -> None:
        """Hand a notice to each target; returns at once."""
        addresses = []
        for target in targets:
            if target == "journal":
                self._journal(notice)
            elif target == "desktop":
                self._announce(notice)
            elif target == OWNER:
                self._to_owner(notice, desktop="desktop" not in targets)  # one Notification signal, not two
            elif target.startswith("webhook:"):
                self.webhook.put(target[len("webhook:") :], notice)
            else:
                addresses.append(target)
        if addresses:  # one message to all the rule's addresses, as a relay would fan it out
            self.mail.put(tuple(addresses), notice)

    def _to_owner(self, notice: Notice, desktop: bool = True) -> None:
        """The subject's owner on each channel they have: terminals, mail by the template, the desktop."""
        uid = notice.data.get("uid")
        if not isinstance(uid, int) or isinstance(uid, bool) or uid < 0:
            self._warned("owner", "", notice, "skipped", "the subject has no single owner")
            self.tty.stats.count(SKIPPED)  # nobody's terminal to write to, nobody's address to mail
            if self.config.owner_mail:
                self.owner_mail.stats.count(SKIPPED)
            return
        self.tty.put(uid, notice)
        if self.config.owner_mail:
            address = owner_address(self.config.owner_mail, uid)
            if address is None:
                self._warned(
                    "mail", f"uid {uid}", notice, "skipped", "owner_mail does not give a plain address for this user"
                )
                self.owner_mail.stats.count(SKIPPED)
            else:
                self.owner_mail.put(address, notice)
        if desktop:
            self._announce(notice)
        self._warned("desktop", f"uid {uid}", notice, "signalled", "")

    def stats(self) -> dict[str, ChannelStats]:
        return {
            "email": self.mail.stats,
            "webhook": self.webhook.stats,
            "owner-mail": self.owner_mail.stats,
            "tty": self.tty.stats,
            "desktop": self.desktop,
        }

    def wait_idle(self, timeout: float) -> bool:
        """For tests and shutdown: True once every queue is drained."""
        return all(c.wait_idle(timeout) for c in self._channels())

    def _channels(self) -> tuple[_Channel, ...]:
        return (self.mail, self.webhook, self.owner_mail, self.tty)

    def close(self) -> None:
        self._stop.set()
        for channel in self._channels():
            channel.wake()

    # -- transports (run in the channel threads) ---------------------------------------------------------

    def _send_mail(self, addresses: tuple[str, ...], notice: Notice) -> str:
        c = self.config
        msg = EmailMessage()
        msg["From"] = c.mail_from or f"gpukilld@{socket.gethostname()}"
        msg["To"] = ", ".join(addresses)
        # A process names itself: its name is in the summary and body. Escaped, a name with CR/LF cannot add
        # headers or make EmailMessage refuse the notice, and one with escape sequences cannot reach a terminal.
        msg["Subject"] = f"[gpukill] {shown(notice.summary)}"
        msg["Date"] = formatdate(localtime=True)
        msg["Message-ID"] = make_msgid(domain=socket.gethostname())
        msg["X-Gpukill-Rule"] = notice.rule
        msg["X-Gpukill-Event"] = notice.event
        msg.set_content("\n".join(shown(line) for line in notice.body.split("\n")))
        # send_message returns once the server answered 250 after DATA; it raises on any refusal of the message
        # or of every recipient. Recipients refused among others are counted with the delivery, and said.
        with smtplib.SMTP(c.smtp_host, c.smtp_port, timeout=c.timeout) as smtp:
            refused = smtp.send_message(msg)
        if refused:
            self.mail.on_failure(
                ", ".join(refused),
                notice,
                "refused by the mail server: "
                + "; ".join(
                    f"{to}: {code} {shown(reply.decode('utf-8', 'replace'))}" for to, (code, reply) in refused.items()
                ),
            )
        return DELIVERED

    def _send_owner_mail(self, address: str, notice: Notice) -> str:
        self._send_mail((address,), notice)
        self._warned("mail", address, notice, "delivered", "")
        return DELIVERED

    def _write_ttys(self, uid: int, notice: Notice) -> str:
        """DELIVERED when at least one terminal took the message (whole or its first part), FAILED when a write
        to a terminal failed and none took it, SKIPPED when there was none to write to."""
        # The bell and the leading newline are ours, as write(1) rings; every line of the notice is escaped.
        text = "\a\n" + "\n".join(
            shown(line)
            for line in [f"Message from gpukilld@{socket.gethostname()}: {notice.summary}", *notice.body.split("\n")]
        )
        deliveries = owner_tty.warn_user(uid, text, self.config.owner_mesg, self.config.utmp, self.config.logind_bus)
        if not deliveries:
            self._warned("tty", f"uid {uid}", notice, "skipped", "no login session with a terminal")
        for d in deliveries:
            self._warned("tty", d.tty, notice, d.outcome, d.detail)
        outcomes = {d.outcome for d in deliveries}
        if outcomes & {"written", "partial"}:
            return DELIVERED
        return FAILED if "failed" in outcomes else SKIPPED

    def _post(self, url: str, notice: Notice) -> str:
        # JSON keeps every value exact; the human summary is escaped as everywhere text is shown to people.
        data = notice.data
        if isinstance(data.get("summary"), str):
            data = {**data, "summary": shown(data["summary"])}
        body = json.dumps(data).encode()
        req = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "gpukilld"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout) as resp:
                resp.read(65536)
            return DELIVERED
        except urllib.error.HTTPError as e:  # a 4xx/5xx answer is a failed delivery: retried, then reported
            raise RuntimeError(f"HTTP {e.code} {e.reason} from {url}") from None
