"""Guard policy files: YAML read through PyYAML's composer, so every error can name FILE:LINE:COL.

A policy is a mapping of top-level settings and a `rules:` list. This package only parses and validates; it
imports nothing of the daemon or D-Bus, so `gpukillctl guard validate` works without the daemon. Validation
reports every error it finds, one line each, and nothing of a file with an error is ever used: the daemon
keeps the policy in force instead. What it builds, and what the words of a rule mean, is gpukill.rules;
which condition types exist, and where each fits, is gpukill.condition_types.

Anyone may send a policy (TestPolicies), so the parser treats its text as hostile. It raises nothing but
PolicyError, whatever the text: numbers of any size, `.inf`/`.nan`, deep nesting and characters PyYAML cannot
take are errors at FILE:LINE:COL. Its work and its output are bounded: nesting depth, items visited (an alias
counts each time it is used), errors reported (MAX_ERRORS, then one final line), the length of every string
and of each condition's text. Regular expressions are RE2 (gpukill.regex: linear time), and the package's own
regular expressions only ever see strings whose length was bounded first.

Its modules, each one seam: bounds (every bound it keeps), messages (PolicyError and the wording of error
lines), yaml_safe (the YAML read safely: libyaml where it is there, nesting bounded, FILE:LINE:COL marks),
readers (typed field readers), values (a condition's value by its type's kind), grammar (settings, rules and
conditions), files (reading guard.d and other paths, parsing each file, merging them into one Policy).
"""

from __future__ import annotations

from .bounds import (
    MAX_DEPTH,
    MAX_DESCRIPTION,
    MAX_DURATION,
    MAX_EMAIL,
    MAX_ERROR_LINE,
    MAX_ERRORS,
    MAX_ID,
    MAX_ID_TEXT,
    MAX_ITEMS,
    MAX_LIST,
    MAX_NAME,
    MAX_NAME_LOOKUPS,
    MAX_NUMBER_TEXT,
    MAX_POLICY_BYTES,
    MAX_REGEX,
    MAX_RESETS_PER_HOUR_LIMIT,
    MAX_RULES,
    MAX_STRING,
    MAX_TEMPERATURE,
    MAX_TEXT,
    MAX_URL,
    MAX_WARNINGS,
    MIN_RESET_COOLDOWN,
    MIN_TEMPERATURE,
)
from .files import (
    build_policy,
    check_text,
    directory_texts,
    load_directory,
    load_paths,
    load_texts,
    name_warnings,
    parse_file_text,
    parse_policy,
    policy_paths,
    read_paths,
    read_text,
)
from .grammar import (
    AT_START,
    CONDITION_KEYS,
    NUMERIC_KINDS,
    RESET_KEYS,
    RULE_KEYS,
    TOP_KEYS,
    PolicyFile,
    _Parser,
)
from .messages import TOO_MANY_ERRORS, PolicyError, capped_errors
from .readers import EXEMPTION_KEYS, notify_target_problem
from .readers import Stop as _Stop

__all__ = [
    "AT_START",
    "CONDITION_KEYS",
    "EXEMPTION_KEYS",
    "MAX_DEPTH",
    "MAX_DESCRIPTION",
    "MAX_DURATION",
    "MAX_EMAIL",
    "MAX_ERRORS",
    "MAX_ERROR_LINE",
    "MAX_ID",
    "MAX_ID_TEXT",
    "MAX_ITEMS",
    "MAX_LIST",
    "MAX_NAME",
    "MAX_NAME_LOOKUPS",
    "MAX_NUMBER_TEXT",
    "MAX_POLICY_BYTES",
    "MAX_REGEX",
    "MAX_RESETS_PER_HOUR_LIMIT",
    "MAX_RULES",
    "MAX_STRING",
    "MAX_TEMPERATURE",
    "MAX_TEXT",
    "MAX_URL",
    "MAX_WARNINGS",
    "MIN_RESET_COOLDOWN",
    "MIN_TEMPERATURE",
    "NUMERIC_KINDS",
    "RESET_KEYS",
    "RULE_KEYS",
    "TOO_MANY_ERRORS",
    "TOP_KEYS",
    "PolicyError",
    "PolicyFile",
    "build_policy",
    "capped_errors",
    "check_text",
    "directory_texts",
    "load_directory",
    "load_paths",
    "load_texts",
    "name_warnings",
    "notify_target_problem",
    "parse_file_text",
    "parse_policy",
    "policy_paths",
    "read_paths",
    "read_text",
    # gpukill.managed_policy reads its export files with the policy's parser: the same text checks, typed
    # readers, errors and bounds
    "_Parser",
    "_Stop",
]
