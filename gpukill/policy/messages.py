"""How a policy's problems are worded: PolicyError and its error lines (one line each, capped in length and in
number), and the policy's own text quoted, cut and described within them."""

from __future__ import annotations

from ..errors import InvalidPolicy
from ..text import shown
from ..units import short
from .bounds import MAX_ERROR_LINE, MAX_ERRORS, MAX_TEXT

TOO_MANY_ERRORS = "… and more errors; fix these first"


class PolicyError(InvalidPolicy):
    """A policy that cannot be used; `errors` holds every problem as 'FILE:LINE:COL: message'."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = capped_errors(errors) or ["(no reason given)"]
        n = len(self.errors) - 1
        more = (
            ""
            if not n
            else (
                " (and many more; see gpukillctl guard validate)"
                if self.errors[-1] == TOO_MANY_ERRORS
                else f" (and {n} more; see gpukillctl guard validate)"
            )
        )
        super().__init__(f"{self.errors[0]}{more}")


def one_line(line: str) -> str:
    """An error line as it is shown: one line (controls escaped), at most MAX_ERROR_LINE characters."""
    line = shown(line)
    return line if len(line) <= MAX_ERROR_LINE else line[: MAX_ERROR_LINE - 1] + "…"


def capped_errors(errors: list[str]) -> list[str]:
    """At most MAX_ERRORS lines, each one line, then TOO_MANY_ERRORS if any were left out (several files'
    errors together, each list capped already, are capped again)."""
    lines: list[str] = []
    more = False
    for e in errors:
        if e == TOO_MANY_ERRORS:
            more = True
        elif len(lines) == MAX_ERRORS:
            more = True
            break
        else:
            lines.append(one_line(e))
    return lines + [TOO_MANY_ERRORS] if more else lines


def quoted(text: str, limit: int = 60) -> str:
    """A string from the policy, quoted and cut: no message carries much of what a policy wrote."""
    return repr(text[:limit]) + ("…" if len(text) > limit else "")


def cut(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def described(value: object) -> str:
    """What a value the policy gives is, for a message saying it is the wrong one."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "nothing (null)"
    if isinstance(value, int | float):
        return f"the number {short(value)}"
    if isinstance(value, str):
        return f"the string {quoted(value)}"
    if isinstance(value, bytes):
        value = value[:40]
    return f"{type(value).__name__} {quoted(str(value)[:100], 40)}"


def close_match(word: str, known: tuple[str, ...]) -> str:
    """' (did you mean 'x'?)' where a known name is close to the word; else nothing."""
    import difflib

    if len(word) > 64:  # no known name is that long; and difflib's cost grows with the word
        return ""

    close = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""
