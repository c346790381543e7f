"""Every bound the policy parser keeps: on the text it reads, the work it does, what it reports, and the
values a policy may give. None of them is near what a real policy needs."""

from __future__ import annotations

from ..regex import MAX_PATTERN

MAX_POLICY_BYTES = 1 << 20  # a policy is a few KiB; a bound keeps a client's text from costing much
MAX_RULES = 1000
MAX_LIST = 10_000  # items in one value or exemption list
MAX_REGEX = MAX_PATTERN  # characters of a `matches` pattern (gpukill.regex)
MAX_NAME = 100
MAX_NAME_LOOKUPS = 1000  # distinct user and group names looked up for name_warnings: NSS may be slow (LDAP)
MAX_DURATION = 30 * 86400.0
# Bounds against hostile text. None of them is near what a real policy needs.
MAX_ERRORS = 100  # error lines kept; then TOO_MANY_ERRORS and parsing stops
MAX_ITEMS = 100_000  # list items, mapping entries, rules and conditions visited; an alias counts at each use
MAX_DEPTH = 64  # nesting of lists and mappings (a policy needs 5)
MAX_TEXT = 200  # characters of a condition's text (shown in reasons, audit entries, TestPolicies)
MAX_ERROR_LINE = 1000  # characters of one error line (a path may take 4096: rare, then cut)
MAX_STRING = 4096  # a string compared with a process's text: command lines are cut at 4 KiB, paths at 4096
MAX_ID_TEXT = 256  # user and group names, exemption patterns (unit names are at most 256 characters)
MAX_DESCRIPTION = 1024
MAX_NUMBER_TEXT = 100  # characters of a number as written: the largest sane value (1 EiB) needs 19 digits
MAX_EMAIL = 254  # RFC 5321's limit on a forward path
MAX_URL = 2048
MAX_ID = 2**32 - 2  # uids and gids are 32 bits; (uid_t)-1 means "no uid"
MIN_TEMPERATURE, MAX_TEMPERATURE = -273.15, 1000.0  # °C
MAX_WARNINGS = 8  # warnings per rule: enough for any schedule, a bound on what one episode sends
MIN_RESET_COOLDOWN, MAX_RESETS_PER_HOUR_LIMIT = 10.0, 60  # a reset takes seconds; a device reset every minute is plenty
MAX_POSTPONE, MAX_POSTPONEMENTS = 7 * 86400.0, 100  # a rule's postpone: max and times; a week of grace is plenty
