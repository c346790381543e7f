"""INI text as gpukilld reads it (gpukilld.conf, its drop-in of audit settings): one parser's settings, and the
line of each key, found with configparser's own rules so that an error names the line the parser read.

configparser forgets line numbers. IniText keeps the text beside the parser and finds a key's line again: a
section header and an option as configparser's patterns match them, comment lines and inline comments (after
a blank) skipped, and option names lower-cased as configparser's optionxform does ("Sample_Interval" is the
key sample_interval).
"""

from __future__ import annotations

import configparser
import re

COMMENTS = ("#", ";")  # whole-line and inline comments
_INLINE_COMMENT = re.compile(r"\s[#;]")  # an inline comment starts after a blank, as configparser's does


def new_parser() -> configparser.ConfigParser:
    return configparser.ConfigParser(inline_comment_prefixes=COMMENTS, interpolation=None)


def line_of(text: str, section: str, key: str) -> int | None:
    """The line of the key in the section, as configparser reads the text; None when it is not there."""
    want = key.lower()
    current = None
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith(COMMENTS):
            continue
        if cut := _INLINE_COMMENT.search(s):
            s = s[: cut.start()].rstrip()
        if header := configparser.ConfigParser.SECTCRE.match(s):
            current = header.group("header")
        elif current == section and _option(s) == want:
            return n
    return None


def _option(line: str) -> str | None:
    """The option a line sets, as configparser names it (lower case), or None."""
    option = configparser.ConfigParser.OPTCRE.match(line)
    return option.group("option").rstrip().lower() if option else None


class IniText:
    """One INI text, parsed: its sections and keys as configparser reads them, and where each key is."""

    def __init__(self, name: str, text: str) -> None:
        """ValueError "NAME:LINE: what" (one line) when configparser cannot read the text."""
        self.name = name
        self.text = text
        self.parser = new_parser()
        try:
            self.parser.read_string(text, source=name)
        except configparser.Error as e:
            first = str(e).splitlines()[0]
            line = getattr(e, "lineno", None)
            raise ValueError(f"{name}:{line}: {first}" if line else f"{name}: {first}") from None

    def where(self, section: str, key: str) -> str:
        """NAME:LINE of the key, for an error about its value (LINE is ? when the key cannot be found)."""
        return f"{self.name}:{line_of(self.text, section, key) or '?'}"

    def has(self, section: str, key: str) -> bool:
        return self.parser.has_option(section, key)

    def get(self, section: str, key: str) -> str:
        return self.parser[section][key]
