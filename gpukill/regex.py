"""Regular expressions from people the daemon does not trust, evaluated in linear time.

Python's `re` backtracks: `(.*)*X` against a long string runs for hours, holding the interpreter lock. Every
pattern a caller or a policy gives (list filters, TestPolicies, `matches` rules) is compiled with RE2
(google-re2), whose matching time is linear in the text and whose compiled program is bounded in memory; a
pattern RE2 cannot run in linear time (backreferences, lookaround) is refused when compiled, with the reason.
The texts it runs on are bounded too (comm 15 bytes, command lines 4 KiB: see procfs), so one match is
bounded work.
"""

from __future__ import annotations

import re2

MAX_PATTERN = 1024  # characters
MAX_PROGRAM_MEMORY = 1 << 20  # bytes RE2 may use for one compiled pattern and its DFA cache

_OPTIONS = re2.Options()
_OPTIONS.max_mem = MAX_PROGRAM_MEMORY
_OPTIONS.log_errors = False  # RE2 would print every rejected pattern to the daemon's stderr


class RegexError(ValueError):
    """A pattern that cannot be used; the message is one line for the caller."""


def compile_regex(pattern: str):
    """A compiled RE2 pattern with `.search(text)`; RegexError saying why not."""
    if len(pattern) > MAX_PATTERN:
        raise RegexError(f"the regular expression is longer than {MAX_PATTERN} characters")
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise RegexError(
            f"not a valid regular expression: {reason} (gpukilld uses RE2 syntax, which runs in "
            "linear time: no backreferences or lookaround)"
        ) from None
