"""Text that processes control, made safe for the places it goes.

A process chooses its own name (prctl PR_SET_NAME takes any byte but NUL), its command line and, through
delegated cgroups, even the names of its units. That text reaches an admin's terminal, e-mail headers, the
journal's stderr fallback and webhook summaries. Two rules, applied where text leaves for a human:

- `shown()` escapes what a terminal or a mail header would interpret (C0 and C1 controls, DEL, line and
  paragraph separators, bidirectional overrides) as `\\xNN` / `\\uNNNN`, as `ps` replaces them with `?`:
  one line, nothing that moves the cursor or reorders what the admin reads.
- `bounded()` cuts text at a byte budget on a character boundary and says how much was cut, so nothing a
  process controls grows a record, a reply or a condition without limit.

JSON and D-Bus records keep the exact text (bounded); only human renderings are escaped.
"""

from __future__ import annotations

import unicodedata

# Categories a terminal or mail client may act on: Cc (controls), Cf (format: bidi overrides, zero-width
# joiners), Zl/Zp (line and paragraph separators). Everything else prints as itself.
# What every human rendering (CLI tables, top, the dashboard, journal text) prints for a value nobody measured:
# an en dash. JSON and D-Bus records keep null; an unknown value never prints as 0. Here rather than in
# gpukill/units.py (whose formatters use it) so that the one-shot listing reaches it without units' imports.
UNKNOWN = "\u2013"

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
_SAFE_ASCII = frozenset(chr(c) for c in range(0x20, 0x7F))


def _escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shown(text: str) -> str:
    """`text` with every control or invisible formatting character escaped. Idempotent (a backslash is left
    as it is), so text the daemon escaped once can be escaped again by a client without doubling."""
    if all(ch in _SAFE_ASCII for ch in text):
        return text  # the common case: plain ASCII names
    out = []
    for ch in text:
        if ch in _SAFE_ASCII or unicodedata.category(ch) not in _UNSAFE_CATEGORIES:
            out.append(ch)
        else:
            out.append(_escape(ch))
    return "".join(out)


def bounded(text: str, max_bytes: int, marker: str = " …[cut {n} bytes]") -> str:
    """`text` cut to at most `max_bytes` bytes of UTF-8 (plus the marker, which says how many were cut)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    cut = raw[:max_bytes].decode("utf-8", "ignore")  # never half a character
    return cut + marker.format(n=len(raw) - len(cut.encode("utf-8")))
