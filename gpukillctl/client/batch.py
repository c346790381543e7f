"""What every batch kill by name shares (gpukill --kill --filter --batch, MCP's kill_processes_by_name): which
patterns may choose the processes, and a listing (one record per process and GPU) taken once per process."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from gpukill.regex import compile_regex


class MatchesEveryName(ValueError):
    """A pattern that matches the empty string: "PATTERN matches the empty string, so every process name"."""


def check_batch_pattern(pattern: str) -> None:
    """gpukill.regex.RegexError for a pattern RE2 cannot use; MatchesEveryName for one that matches the empty string
    ("", ".*", "x*", "a|"), so every name (gpukilld searches the name, as gpu-kill does). Killing every GPU process
    is another request than killing some by name, and such a pattern is usually a slip: refused, not taken
    literally."""
    if compile_regex(pattern).search("") is not None:
        raise MatchesEveryName(f"{pattern!r} matches the empty string, so every process name")


class OfProcess(Protocol):
    """A listing's record or a reference to a process: the (pid, start time) that names one process."""

    @property
    def pid(self) -> int: ...

    @property
    def start_time(self) -> int: ...


P = TypeVar("P", bound=OfProcess)


def by_process(items: Iterable[P]) -> dict[tuple[int, int], list[P]]:
    """items grouped by the process they are of, its (pid, start time), in the order first seen: a process on two
    GPUs is two records of a listing, and one process to kill."""
    groups: dict[tuple[int, int], list[P]] = {}
    for item in items:
        groups.setdefault((item.pid, item.start_time), []).append(item)
    return groups


def once_per_process(items: Iterable[P]) -> list[P]:
    """The first of items for each process, in their order."""
    return [group[0] for group in by_process(items).values()]
