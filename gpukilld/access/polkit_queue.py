"""Turns at polkit: which authorization checks are asked now, and which wait, per person and in order.

Every CheckAuthorization is a pending reply on gpukilld's bus connection, and dbus-daemon allows a connection 128
of them (max_replies_per_connection): past that, every further authorization would fail. So at most IN_FLIGHT
checks are at polkit at once, and the others wait their turn here instead of being refused: a script's burst of
kills is served in order. Each person (people.py: a uid and its subordinate uids) has two lanes, one for checks
that allow user interaction and one for the others, each first come first served:

- A lane has at most IN_FLIGHT_PER_LANE of its checks at polkit at once, so that no person fills IN_FLIGHT.
  An interactive check may wait minutes for a password (or forever, for an agent that never answers): those
  hold only their own lane, never the person's other checks.
- A lane holds at most QUEUE_PER_LANE checks, at polkit or waiting, and all lanes together QUEUE_TOTAL (a bound
  on the daemon's memory whoever calls): past either, TooBusy at once. That is the only refusal.
- When a turn frees, the lanes that wait take turns round robin: one person's queue never holds back another's.
- A check waits at most its timeout, counted from its arrival (TimeoutError): the queue adds no time to it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from gpukill.errors import TooBusy

IN_FLIGHT = 64  # checks at polkit, everyone together: half of dbus-daemon's 128 pending replies
IN_FLIGHT_PER_LANE = {False: 4, True: 2}  # a person's checks at polkit at once, by interactive
QUEUE_PER_LANE = 64  # a person's checks of one kind at polkit or waiting
QUEUE_TOTAL = 1024  # waiting, everyone together

Lane = tuple[int, bool]  # (person, interactive)


class PolkitQueue:
    def __init__(
        self,
        in_flight: int = IN_FLIGHT,
        in_flight_per_lane: dict[bool, int] | None = None,
        queue_per_lane: int = QUEUE_PER_LANE,
        queue_total: int = QUEUE_TOTAL,
    ) -> None:
        self.in_flight_max = in_flight
        self.in_flight_per_lane = in_flight_per_lane or IN_FLIGHT_PER_LANE
        self.queue_per_lane = queue_per_lane
        self.queue_total = queue_total
        self.in_flight = 0
        self.waiting = 0
        self._asked: dict[Lane, int] = {}  # lane -> its checks at polkit now
        self._waiters: dict[Lane, deque[asyncio.Future[None]]] = {}  # lane -> its checks waiting, in order
        self._turns: deque[Lane] = deque()  # lanes with checks waiting, in the order they get the next turn

    def asked(self, person: int, interactive: bool) -> int:
        return self._asked.get((person, interactive), 0)

    def queued(self, person: int, interactive: bool) -> int:
        lane = (person, interactive)
        return self._asked.get(lane, 0) + len(self._waiters.get(lane, ()))

    async def take(self, person: int, interactive: bool, wait: float, who: str) -> None:
        """Return when the check may be asked at polkit (then give_back() it once answered); TooBusy at once when
        its lane or the whole queue is full, TimeoutError when no turn came within `wait` seconds. who: the
        person, as the TooBusy message names it."""
        lane = (person, interactive)
        if not self._waiters.get(lane) and self._may_ask(lane):
            self._ask(lane)
            return
        if self.queued(person, interactive) >= self.queue_per_lane:
            kind = "interactive authorizations (password prompts?)" if interactive else "authorizations"
            raise TooBusy(
                f"{who} already has {self.queue_per_lane} {kind} waiting for polkit; "
                + ("answer or cancel those first" if interactive else "try again when they are answered")
            )
        if self.waiting >= self.queue_total:
            raise TooBusy("too many authorizations are waiting for polkit; try again in a moment")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(lane, deque())
        if not waiters:
            self._turns.append(lane)
        waiters.append(turn)
        self.waiting += 1
        try:
            async with asyncio.timeout(wait):
                await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.give_back(person, interactive)  # the turn came as the wait ended: pass it on
            else:
                self._forget(lane, turn)
            raise

    def give_back(self, person: int, interactive: bool) -> None:
        """A check taken with take() is answered: its turn goes to the next lane waiting."""
        lane = (person, interactive)
        left = self._asked[lane] - 1
        if left:
            self._asked[lane] = left
        else:
            del self._asked[lane]
        self.in_flight -= 1
        self._next()

    def _may_ask(self, lane: Lane) -> bool:
        return self.in_flight < self.in_flight_max and self._asked.get(lane, 0) < self.in_flight_per_lane[lane[1]]

    def _ask(self, lane: Lane) -> None:
        self._asked[lane] = self._asked.get(lane, 0) + 1
        self.in_flight += 1

    def _next(self) -> None:
        """Give turns to waiting lanes, one each round robin, while polkit has room."""
        for _ in range(len(self._turns)):
            if self.in_flight >= self.in_flight_max:
                return
            lane = self._turns.popleft()
            waiters = self._waiters[lane]
            while waiters and waiters[0].done():  # its wait ended (cancelled) before it could forget its place
                waiters.popleft()
                self.waiting -= 1
            if waiters and self._may_ask(lane):
                turn = waiters.popleft()
                self.waiting -= 1
                self._ask(lane)
                turn.set_result(None)
            if waiters:
                self._turns.append(lane)
            else:
                del self._waiters[lane]

    def _forget(self, lane: Lane, turn: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(lane)
        if waiters is None or turn not in waiters:
            return
        waiters.remove(turn)
        self.waiting -= 1
        if not waiters:
            del self._waiters[lane]
            self._turns.remove(lane)
