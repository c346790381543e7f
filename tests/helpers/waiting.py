"""Waiting for something a test cannot be told about: polling until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    cond: Callable[[], T],
    timeout: float = 10.0,
    what: str | Callable[[], str] = "the condition never held",
    *,
    interval: float = 0.1,
    fail: bool = True,
) -> T:
    """Call cond() every `interval` seconds until it returns something truthy, and return that value.

    cond() is called at least once, and once more after the timeout. If it is still falsy then: raise
    AssertionError "<what> (after <timeout>s)", `what` saying what did not happen (a callable is called then,
    for a message with the state at that time); or, with fail=False, return cond()'s last, falsy, value, for
    a caller that reports the failure itself or goes on without it."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            break
        time.sleep(interval)
    if value or not fail:
        return value
    raise AssertionError(f"{what() if callable(what) else what} (after {timeout}s)")
