"""gpukillctl top: a live view of the GPUs and their processes, in the terminal, through gpukilld only.

The view is stdlib curses (why: docs/using.md, "gpukillctl top"); what it shows and how keys change it is
gpukillctl/top/model.py, which knows nothing of terminals. This module runs the two on one asyncio loop:

- a refresh task fetches devices, processes (paged by the client library), the suspended processes, the
  daemon's status and Guard's status, then sleeps what is left of the daemon's sample interval: the view is
  never refreshed faster than gpukilld samples, and a key never waits for the bus. It fetches only when
  gpukilld signalled a change since the last fetch (model.must_fetch says when: ProcessSuspended and
  ProcessResumed among them); on the other ticks it only redraws, so that runtimes still move;
- keys are read when the terminal has input (add_reader on stdin) and the screen is redrawn at once from
  the sample already held;
- the session's totals line (GPU time, memory, energy since top started) is GetUsage at most every
  USAGE_EVERY seconds, not per frame: the accounting moves slowly and is read from the daemon's store;
- a confirmed kill is asked with interactive authorization. While the daemon decides, the view is suspended
  (curses.endwin) and pkttyagent (polkit_agent.PolkitAgent) has the plain terminal, so a polkit password
  prompt works as it does for `gpukillctl kill`; the daemon's answer, a denial included, comes back as the
  view's message line. Where no agent runs (root, no pkttyagent) the view is not suspended at all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import curses
import locale
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping

from gpukill.procstat import CLK_TCK
from gpukill.text import UNKNOWN

from ..client.dbus import ClientError, GpukillClient
from ..client.format import user_name
from ..client.polkit_agent import PolkitAgent
from .model import (
    BAR,
    DIM,
    ERROR,
    GRACE,
    HEADER,
    HEAVY,
    LIGHT,
    MODERATE,
    QUIT,
    SELECTED,
    TITLE,
    WINDOW,
    KillRequest,
    Line,
    Sample,
    TopState,
    cells,
    must_fetch,
    render,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = (
    0,
    1,
    2,
)  # as gpukillctl/client/exits.py; gpukillctl/cli/main.py imports us, so not from there
USAGE_EVERY = 10.0  # seconds between GetUsage calls for the session's totals line
ESCAPE_DELAY_MS = 25  # Esc alone is told from an escape sequence after this long (ncurses' default: 1 s)
STDIN = 0

_KEY_NAMES = {
    curses.KEY_UP: "UP",
    curses.KEY_DOWN: "DOWN",
    curses.KEY_PPAGE: "PGUP",
    curses.KEY_NPAGE: "PGDN",
    curses.KEY_HOME: "HOME",
    curses.KEY_END: "END",
    curses.KEY_ENTER: "ENTER",
    curses.KEY_BACKSPACE: "BACKSPACE",
}
_CHAR_NAMES = {"\n": "ENTER", "\r": "ENTER", "\x1b": "ESC", "\x7f": "BACKSPACE", "\b": "BACKSPACE", "\x15": "CLEAR"}


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "top",
        help="live view of GPUs and processes: sort, filter (/), kill (k), quit (q)",
        description="A live view refreshed at gpukilld's sample interval. Keys: Up/Down/PgUp/PgDn "
        "select; m, u, n, t sort by GPU memory, utilization, user, runtime (again: "
        "reverse); / filter; Esc clears it; k kills the selected process after a "
        "confirmation (polkit decides); q quits.",
    )


async def fetch(client: GpukillClient) -> tuple[Sample, str]:
    """One sample through the client library, and why Guard's part is missing ("" when it is there)."""
    status, devices, processes, guard, suspended = await asyncio.gather(
        client.status(),
        client.list_devices(),
        client.list_processes(),
        client.guard_status(),
        client.suspended(),
        return_exceptions=True,
    )
    for result in (status, devices, processes, suspended):
        if isinstance(result, BaseException):
            raise result
    boottime, wall = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
    sample = Sample(
        # an exception among them was raised above: mypy does not narrow through the loop (the ignores)
        devices=tuple(devices),  # type: ignore[arg-type]
        processes=tuple(processes),  # type: ignore[arg-type]
        guard=None if isinstance(guard, BaseException) else guard,
        interval=status.sample_interval,  # type: ignore[union-attr]
        boottime=boottime,
        clock_ticks=CLK_TCK,
        suspended=tuple(suspended),  # type: ignore[arg-type]
        user_names=tuple((uid, user_name(uid)) for uid in {s.uid for s in suspended}),  # type: ignore[union-attr]
        wall=wall,
    )
    if isinstance(guard, ClientError):
        return sample, f"guard status unavailable: {guard}"
    if isinstance(guard, BaseException):
        raise guard
    return sample, ""


def colour_wanted(environ: Mapping[str, str]) -> bool:
    """Colour unless NO_COLOR is set to anything but the empty string (no-color.org). top runs only on a
    terminal (cmd_top refuses anything else), so there is no pipe to keep escapes out of."""
    return not environ.get("NO_COLOR")


def _styles(colour: bool) -> dict[str, int]:
    """Attributes by style: bold, reverse and underline always; colours only where wanted and the terminal has
    them (red for errors and graces, yellow for windows, green/yellow/red for a load)."""
    styles = {
        TITLE: curses.A_REVERSE | curses.A_BOLD,
        HEADER: curses.A_BOLD | curses.A_UNDERLINE,
        SELECTED: curses.A_REVERSE,
        ERROR: curses.A_BOLD,
        GRACE: curses.A_BOLD,
        WINDOW: curses.A_NORMAL,
        DIM: curses.A_NORMAL,
        BAR: curses.A_NORMAL,
        LIGHT: curses.A_NORMAL,
        MODERATE: curses.A_NORMAL,
        HEAVY: curses.A_BOLD,
    }
    if colour and curses.has_colors():
        curses.start_color()
        with contextlib.suppress(curses.error):
            curses.use_default_colors()
        background = -1 if curses.COLORS else curses.COLOR_BLACK
        for pair, (style, color) in enumerate(
            (
                (ERROR, curses.COLOR_RED),
                (GRACE, curses.COLOR_RED),
                (WINDOW, curses.COLOR_YELLOW),
                (DIM, curses.COLOR_CYAN),
                (LIGHT, curses.COLOR_GREEN),
                (MODERATE, curses.COLOR_YELLOW),
                (HEAVY, curses.COLOR_RED),
            ),
            1,
        ):
            with contextlib.suppress(curses.error):
                curses.init_pair(pair, color, background)
                styles[style] |= curses.color_pair(pair)
    return styles


@contextlib.contextmanager
def terminal() -> Iterator[curses.window]:
    """The terminal in curses mode for the view, restored whatever happens."""
    locale.setlocale(locale.LC_ALL, "")  # wide characters: names are UTF-8
    stdscr = curses.initscr()
    try:
        curses.noecho()
        curses.cbreak()  # Ctrl-C still interrupts
        stdscr.keypad(True)
        stdscr.nodelay(True)
        curses.set_escdelay(ESCAPE_DELAY_MS)
        with contextlib.suppress(curses.error):
            curses.curs_set(0)
        yield stdscr
    finally:
        stdscr.keypad(False)
        curses.nocbreak()
        curses.echo()
        curses.endwin()


class TopView:
    """The terminal side: reads keys, paints render()'s lines, runs the refresh and the kills."""

    def __init__(self, client: GpukillClient, stdscr: curses.window, state: TopState, fetched: float) -> None:
        self.client = client
        self.stdscr = stdscr
        self.state = state
        self.styles = _styles(colour_wanted(os.environ))
        self.encoding = locale.getpreferredencoding(False)
        self.utf8 = self.encoding.replace("-", "").lower() == "utf8"
        self.suspended = False
        self.done = asyncio.Event()
        self.refresh_note = ""  # the refresh's own message, replaced when the next refresh succeeds
        self.tasks: set[asyncio.Task] = set()
        self.fetched = fetched  # time.monotonic() when the sample in state was asked for
        self.full_at = fetched  # ... and when it was last fetched from gpukilld (not just redrawn)
        self.changed = asyncio.Event()  # gpukilld signalled something since the last fetch
        self.listening_since: float | None = None  # when the signal listener started; None: not listening
        self.started = time.time()  # the session's start: GetUsage's since for the totals line
        self.usage_at: float | None = None  # time.monotonic() of the last GetUsage; None: not yet asked
        self.usage_off = False  # the daemon keeps no accounting: never asked again

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_reader(STDIN, self.on_input)
        loop.add_signal_handler(signal.SIGWINCH, self.on_resize)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self.on_interrupt)
        refresher = asyncio.create_task(self.refresh())
        totals = asyncio.create_task(self.usage_loop())
        try:
            self.draw()
            await self.done.wait()
        finally:
            refresher.cancel()
            totals.cancel()
            for task in self.tasks:
                task.cancel()
            loop.remove_reader(STDIN)
            for sig in (signal.SIGWINCH, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        return EXIT_OK

    async def listen(self) -> None:
        """Note each signal of gpukilld (a restart included: the new daemon signals once it owns its name), so
        that refresh() fetches only then. When the signals cannot be had, refresh() goes on polling."""
        self.listening_since = time.monotonic()
        try:
            async for _event in self.client.events(on_absent=self.changed.set):
                self.changed.set()
        except Exception:  # a client error, or a bug: either way, polling at every tick still works
            pass
        finally:
            self.listening_since = None

    async def refresh(self) -> None:
        """Sleep what is left of the sample interval since the last fetch, then fetch if anything may have
        changed (else only redraw: runtimes move), draw; failures go to the message line and are tried again
        at the same pace."""
        listener = asyncio.create_task(self.listen())
        try:
            await self._refresh()
        finally:
            listener.cancel()

    async def usage_loop(self) -> None:
        """The totals line's own pace, apart from the refresh: a slow GetUsage never holds up the listing."""
        while not self.usage_off:
            await self.session_usage()
            self.draw()
            await asyncio.sleep(USAGE_EVERY)

    async def session_usage(self) -> None:
        """The session's totals, when USAGE_EVERY has passed since they were last asked; a failure is said on
        the totals line itself (the view goes on)."""
        from gpukill import errors

        now = time.monotonic()
        if self.usage_off or (self.usage_at is not None and now - self.usage_at < USAGE_EVERY):
            return
        self.usage_at = now
        wall = time.time()
        try:
            self.state.usage = await self.client.usage(
                {"since": self.started, "until": max(wall, self.started + 1), "by": "user"}
            )
            self.state.usage_note = ""
        except errors.NotSupported as e:
            self.usage_off = True
            self.state.usage, self.state.usage_note = None, f"no totals: {e}"
        except ClientError as e:
            self.state.usage_note = f"no totals: {e}"

    async def _refresh(self) -> None:
        while True:
            interval = max(self.state.sample.interval, 0.1)
            await asyncio.sleep(max(interval - (time.monotonic() - self.fetched), 0.0))
            self.fetched = now = time.monotonic()
            if not must_fetch(
                self.state.sample,
                now,
                listening_since=self.listening_since,
                changed=self.changed.is_set(),
                fetched_at=self.full_at,
            ):
                self.state.update(self.state.sample.at(time.clock_gettime(time.CLOCK_BOOTTIME)))
                self.draw()
                continue
            self.changed.clear()
            self.full_at = now
            try:
                sample, note = await fetch(self.client)
                self.state.update(sample)
                self._note(note)
            except ClientError as e:
                self._note(f"cannot refresh: {e}")
            except Exception as e:  # a bug: said on the message line, not a view frozen on an old sample
                self._note(f"cannot refresh: internal error: {type(e).__name__}: {e}")
            self.draw()

    def _note(self, note: str) -> None:
        if note:
            self.state.say(note, error=True)
        elif self.refresh_note and self.state.message == self.refresh_note:
            self.state.say("")
        self.refresh_note = note

    # -- input --

    def on_input(self) -> None:
        while True:
            try:
                ch = self.stdscr.get_wch()
            except curses.error:  # nothing more to read
                break
            if ch == curses.KEY_RESIZE:
                self.on_resize()
                continue
            name = _KEY_NAMES.get(ch) if isinstance(ch, int) else _CHAR_NAMES.get(ch, ch)
            if name is None or (len(name) == 1 and not name.isprintable()):
                continue
            action = self.state.key(name)
            if action == QUIT:
                self.done.set()
                return
            if isinstance(action, KillRequest):
                task = asyncio.create_task(self.kill(action))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        self.draw()

    def on_resize(self) -> None:
        with contextlib.suppress(OSError, curses.error):
            size = os.get_terminal_size(sys.__stdout__.fileno())  # type: ignore[union-attr]  # curses: a terminal
            curses.resizeterm(size.lines, size.columns)
        self.draw()

    def on_interrupt(self) -> None:
        # While pkttyagent has the terminal, Ctrl-C is for it (it gives up; polkit then says no, and the
        # denial comes back here); otherwise it quits like q.
        if not self.suspended:
            self.done.set()

    # -- kill --

    async def kill(self, request: KillRequest) -> None:
        agent: PolkitAgent | None = None
        try:
            self.suspend(f"gpukillctl top: stopping PID {request.pid}; polkit may ask for a password here.")
            agent = PolkitAgent()
            if not agent.active:  # no prompt can come: back to the view while the daemon works
                self.resume()
            outcome = await self.client.kill(
                request.pid, request.start_time, force=request.force, interactive=agent.active
            )
            self.state.killed(request, outcome)
        except ClientError as e:
            self.state.killed(request, None, str(e))
        except OSError as e:  # pkttyagent could not be started
            self.state.killed(request, None, f"cannot ask polkit: {e.strerror or e}")
        finally:
            if agent is not None:
                agent.close()
            self.resume()
            self.draw()

    def suspend(self, line: str) -> None:
        """Hand the plain terminal over (to pkttyagent): no drawing, no reading keys, until resume()."""
        asyncio.get_running_loop().remove_reader(STDIN)
        self.suspended = True
        curses.endwin()
        sys.stdout.write("\n" + line + "\n")
        sys.stdout.flush()

    def resume(self) -> None:
        if not self.suspended:
            return
        self.suspended = False
        curses.flushinp()  # what was typed for pkttyagent is not for us
        self.stdscr.clearok(True)
        self.stdscr.refresh()  # back in curses mode (the terminal modes endwin restored are set again)
        asyncio.get_running_loop().add_reader(STDIN, self.on_input)

    # -- output --

    def draw(self) -> None:
        if self.suspended:
            return
        height, width = self.stdscr.getmaxyx()
        self.stdscr.erase()
        for y, line in enumerate(render(self.state, width, height)[:height]):
            self._paint(y, line, width)
        self.stdscr.noutrefresh()
        curses.doupdate()

    def _paint(self, y: int, line: Line, width: int) -> None:
        x = 0
        for text, style in line:
            if x >= width:
                break
            shown_text = (
                text
                if self.utf8 or text.isascii()
                else text.replace(UNKNOWN, "-").encode(self.encoding, "replace").decode(self.encoding)
            )
            with contextlib.suppress(curses.error):  # the bottom-right cell: the cursor cannot move past it
                self.stdscr.addstr(y, x, shown_text, self.styles.get(style, curses.A_NORMAL))
            x += len(text) if text.isascii() else sum(map(cells, text))


async def cmd_top(client: GpukillClient, args: argparse.Namespace) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("gpukillctl: top needs a terminal (for scripts: gpukillctl list --json)", file=sys.stderr)
        return EXIT_USAGE
    fetched = time.monotonic()
    sample, note = await fetch(client)  # gpukilld unreachable: a one-line error before the screen is taken
    state = TopState()
    state.update(sample)
    if note:
        state.say(note, error=True)
    try:
        with terminal() as stdscr:
            return await TopView(client, stdscr, state, fetched).run()
    except curses.error as e:
        print(f"gpukillctl: top cannot use this terminal (TERM={os.environ.get('TERM', '')}): {e}", file=sys.stderr)
        return EXIT_FAILURE
