"""One grammar for sizes and one for durations (gpukill.units), everywhere a person types one: every option of
gpukillctl's and gpukill's parsers and every policy key that takes a size or a duration accepts the same forms
("90min", "1h30m", "4GiB") and refuses the same ("8" for a size, "5 parsecs").

The options and keys are found, not listed: the parsers are walked (an option is a size by its metavar SIZE, a
duration by DURATION, a time by TIME), every other metavar must be one known to take neither, and every policy
key and condition type is classified; so a new option or key that takes a size or a duration outside the
grammar fails here. Pure: no daemon, no root.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpukill.condition_types import CONDITION_TYPES, DURATION, SIZE
from gpukill.policy import CONDITION_KEYS, RULE_KEYS, TOP_KEYS, PolicyError, load_texts
from gpukill.units import parse_size
from gpukillctl.cli.compat import build_parser as gpukill_parser
from gpukillctl.cli.main import build_parser as gpukillctl_parser
from gpukillctl.client.usage import parse_when

GIB = 1 << 30
NOW = 1_800_000_000.0
# Forms of one duration, 90 seconds, as systemd admins write it: each must mean 90 s wherever one is taken.
NINETY_SECONDS = ("90", "90s", "90sec", "90 seconds", "1min 30s", "1m30s", "1.5min", "1.5 minutes", "90000ms", "1M30S")
# Forms of 90 minutes: the same outcome everywhere (the value, or the option's own range refusing it).
NINETY_MINUTES = ("90min", "1h30m", "1h 30min", "5400s", "1.5h")
NOT_DURATIONS = ("5 parsecs", "4GiB", "-5m", "5m3", "soon", "")
SIZES = {"4GiB": 4 * GIB, "4 GiB": 4 * GIB, "4096MiB": 4 * GIB, "4G": 4 * GIB, "4gib": 4 * GIB, "4294967296B": 4 * GIB}
NOT_SIZES = ("8", "4294967296", "5 parsecs", "90min", "lots", "-4GiB")

SIZE_METAVARS = ("SIZE",)
DURATION_METAVARS = ("DURATION",)
TIME_METAVARS = ("TIME",)
# gpukill's gpu-kill flags, which keep the unit gpu-kill documents for a bare number (GB is GiB, seconds, hours).
GPU_KILL_UNITS = {"GB": "size", "SECONDS": "duration", "HOURS": "hours"}
# Metavars of options that take neither a size nor a duration. A new metavar must be added here or classified.
NEITHER = {
    None,
    "PID",
    "ID",
    "UNIT",
    "TICKS",
    "DEVICE",
    "FILE",
    "KIND",
    "TARGET",
    "PCT",
    "N",
    "U[,U...]",
    "GROUP",
    "PTS",
    "KEY=VALUE",
    "USER",
    "NAME",
    "JOB",
    "POD",
    "ADDR:PORT",
    "[USER@]HOST[:PORT]",
    "ADDR",
    "DIR",
    "VENDOR",
    "REGEX",
    "GPU",
    "PERCENT",
    "COUNT",
    "MEMBERS",
    "GPU_INDEX",
    "USERS",
    "VALUE",
    "PATH",
    "PORT",
    "HOST",
    "TEXT",  # free text: gpukillctl postpone --reason
}


def _options(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.nargs != 0:  # flags take no value
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action


OPTIONS = [*_options(gpukillctl_parser(), "gpukillctl"), *_options(gpukill_parser(), "gpukill")]


def _kind(where: str, action: argparse.Action) -> str:
    if action.metavar in SIZE_METAVARS:
        return "size"
    if action.metavar in DURATION_METAVARS:
        return "duration"
    if action.metavar in TIME_METAVARS:
        return "time"
    if where.startswith("gpukill ") and action.metavar in GPU_KILL_UNITS:
        return GPU_KILL_UNITS[action.metavar]
    return "neither" if action.metavar in NEITHER else "unclassified"


def _by_kind(kind: str) -> list[tuple[str, argparse.Action]]:
    return [(where, a) for where, a in OPTIONS if _kind(where, a) == kind]


def _convert(action: argparse.Action, text: str) -> Any:
    """The option's value as its parser reads text, or the exception it refuses it with."""
    try:
        return action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError) as e:
        return e


def test_every_option_is_classified_and_each_kind_is_found():
    kinds = {where: _kind(where, a) for where, a in OPTIONS}
    assert not [w for w, k in kinds.items() if k == "unclassified"], "a metavar neither known nor classified"
    for where in (
        "gpukillctl list --min-memory",
        "gpukillctl guard policy add --memory-limit",
        "gpukillctl guard policy add --reserved-memory",
        "gpukillctl audit --idle-min-memory",
    ):
        assert kinds[where] == "size", where
    for where in (
        "gpukillctl kill --grace",
        "gpukillctl guard policy add --grace",
        "gpukillctl audit --idle-after",
        "gpukillctl exporter --interval",
    ):
        assert kinds[where] == "duration", where
    assert kinds["gpukillctl usage --since"] == kinds["gpukillctl usage --until"] == "time"
    assert kinds["gpukill --guard-memory-limit"] == "size" and kinds["gpukill --timeout-secs"] == "duration"


@pytest.mark.parametrize(("where", "action"), _by_kind("size"), ids=[w for w, _ in _by_kind("size")])
def test_every_size_option_takes_the_size_grammar(where, action):
    gpu_kill = where.startswith("gpukill ")
    for text, size in SIZES.items():
        value = _convert(action, text)
        assert not isinstance(value, Exception), (where, text, value)
        assert (parse_size(value) if isinstance(value, str) else value) == size, (where, text)
    for text in NOT_SIZES:
        value = _convert(action, text)
        if gpu_kill and text in ("8", "4294967296"):
            continue  # gpu-kill's GB: a bare number is GiB, as gpu-kill documents (checked below)
        assert isinstance(value, Exception), (where, text, value)
        assert "\n" not in str(value) and (
            "write a unit: 8GiB, 8GB, 512MiB, 4096B" in str(value) or "not a size" in str(value)
        ), (where, text, value)
    if gpu_kill:
        assert _convert(action, "8") == 8 * GIB and _convert(action, "1.5") == 3 * GIB // 2
    else:
        assert "a bare number is not a size: '8'" in str(_convert(action, "8")), where


@pytest.mark.parametrize(("where", "action"), _by_kind("duration"), ids=[w for w, _ in _by_kind("duration")])
def test_every_duration_option_takes_the_duration_grammar(where, action):
    for text in NINETY_SECONDS:
        assert _convert(action, text) == 90.0, (where, text)
    outcomes = {text: _convert(action, text) for text in NINETY_MINUTES}
    accepted = {text: v for text, v in outcomes.items() if not isinstance(v, Exception)}
    assert not accepted or len(accepted) == len(outcomes) and set(accepted.values()) == {5400.0}, (where, outcomes)
    for text in NOT_DURATIONS:
        value = _convert(action, text)
        assert isinstance(value, Exception) and "\n" not in str(value), (where, text, value)


@pytest.mark.parametrize(("where", "action"), _by_kind("time"), ids=[w for w, _ in _by_kind("time")])
def test_every_time_option_reads_a_duration_ago_in_the_same_grammar(where, action):
    for text in ("90min", "1h30m", "1h 30min", "5400s", "1.5h"):
        assert parse_when(text, NOW) == NOW - 5400
        assert not isinstance(_convert(action, text), Exception), (where, text)
    for text in ("5 parsecs", "90", "4GiB"):
        assert isinstance(_convert(action, text), Exception), (where, text)


# -- policies ---------------------------------------------------------------------------------------------

KILL_RULE = "rules:\n  - name: r\n    action: kill\n{extra}    conditions:\n{conditions}"
NAME_CONDITION = "      - {type: process_name, operator: ==, value: x}\n"
# Every policy key that takes a duration: (how to write it into a policy with VALUE, how to read it back).
DURATION_KEYS: dict[str, tuple[str, Callable[[Any], float]]] = {
    "sample_interval": ("sample_interval: VALUE\nrules: []\n", lambda p: p.settings.sample_interval),
    "cooldown": ("cooldown: VALUE\nrules: []\n", lambda p: p.settings.cooldown),
    "kill_grace": ("kill_grace: VALUE\nrules: []\n", lambda p: p.settings.kill_grace),
    "max_checkpoint_wait": ("max_checkpoint_wait: VALUE\nrules: []\n", lambda p: p.settings.max_checkpoint_wait),
    "rule checkpoint wait": (
        KILL_RULE.format(extra="    checkpoint: {signal: USR1, wait: VALUE}\n", conditions=NAME_CONDITION),
        lambda p: p.rules[0].checkpoint.wait,
    ),
    "rule grace_period": (
        KILL_RULE.format(extra="    grace_period: VALUE\n", conditions=NAME_CONDITION),
        lambda p: p.rules[0].grace_period,
    ),
    "rule kill_grace": (
        KILL_RULE.format(extra="    kill_grace: VALUE\n", conditions=NAME_CONDITION),
        lambda p: p.rules[0].kill_grace,
    ),
    "rule warn": (
        KILL_RULE.format(extra="    grace_period: 6h\n    warn: [VALUE]\n", conditions=NAME_CONDITION),
        lambda p: p.rules[0].warn[0],
    ),
    "rule postpone": (
        KILL_RULE.format(
            extra="    grace_period: 6h\n    postpone: {max: VALUE, times: 2}\n", conditions=NAME_CONDITION
        ),
        lambda p: p.rules[0].postpone.max,
    ),
    "rule cooldown": (
        "rules:\n  - name: r\n    action: reset\n    scope: per_device\n    cooldown: VALUE\n"
        "    conditions:\n      - {type: gpu_utilization, operator: '>', value: 95}\n",
        lambda p: p.rules[0].cooldown,
    ),
    "condition duration": (
        KILL_RULE.format(
            extra="", conditions="      - {type: gpu_utilization, operator: '>', value: 95, duration: VALUE}\n"
        ),
        lambda p: p.rules[0].conditions[0].duration,
    ),
}
# Every other key, so that a new key is classified here before it can take a duration or a size unseen.
NOT_DURATION_KEYS = {
    "rules",
    "dry_run",
    "max_kills_per_cycle",
    "notify",
    "exemptions",
    "name",
    "description",
    "conditions",
    "match",
    "scope",
    "action",
    "force",
    "max_resets_per_hour",
    "kill_scope",
    "checkpoint",
    "type",
    "operator",
    "over",
}
# Rules a condition of any type can sit in, one of which takes it: its value is read back from the first condition.
HOLDERS = (
    KILL_RULE.format(extra="", conditions="      - {COND}\n"),
    KILL_RULE.format(extra="    scope: per_user\n", conditions="      - {COND}\n"),
    KILL_RULE.format(extra="    scope: per_device\n", conditions="      - {COND}\n"),
    KILL_RULE.format(
        extra="    scope: per_group\n",
        conditions="      - {COND}\n      - {type: group, operator: ==, value: research}\n",
    ),
)


def _load(text: str) -> Any:
    try:
        return load_texts([("p.yaml", text)])
    except PolicyError as e:
        return e


def _condition_key(ctype: str, value: str) -> str:
    return f"{{type: {ctype}, operator: '>', value: {value}}}"


def _holder(ctype: str, sample: str) -> str:
    """The first rule in which a condition of this type with this value loads: the type's place to test."""
    for holder in HOLDERS:
        text = holder.replace("{COND}", _condition_key(ctype, sample))
        if not isinstance(_load(text), PolicyError):
            return holder
    raise AssertionError(f"no rule takes a {ctype} condition of {sample}")


def _policy_keys() -> dict[str, tuple[str, Callable[[Any], Any]]]:
    keys = dict(DURATION_KEYS)
    for t in CONDITION_TYPES.values():
        if t.kind == DURATION:
            keys[f"{t.name} value"] = (
                _holder(t.name, "90s").replace("{COND}", _condition_key(t.name, "VALUE")),
                lambda p: p.rules[0].conditions[0].value,
            )
    return keys


def test_every_policy_key_is_classified():
    keys = set(TOP_KEYS) | set(RULE_KEYS) | set(CONDITION_KEYS)
    durations = {k.split()[-1] for k in DURATION_KEYS} | {"value"}
    assert keys <= durations | NOT_DURATION_KEYS, keys - durations - NOT_DURATION_KEYS
    assert {t.name for t in CONDITION_TYPES.values() if t.kind == SIZE} >= {
        "gpu_memory",
        "user_memory",
        "device_memory_free",
    }


@pytest.mark.parametrize("key", sorted(_policy_keys()))
def test_every_policy_duration_takes_the_duration_grammar(key):
    template, read = _policy_keys()[key]

    def value(text: str) -> Any:
        loaded = _load(template.replace("VALUE", text if text else "''"))
        return loaded if isinstance(loaded, PolicyError) else read(loaded)

    for text in NINETY_SECONDS:
        assert value(f"'{text}'") == 90.0, (key, text)
    outcomes = {text: value(f"'{text}'") for text in NINETY_MINUTES}
    accepted = {t: v for t, v in outcomes.items() if not isinstance(v, PolicyError)}
    assert not accepted or len(accepted) == len(outcomes) and set(accepted.values()) == {5400.0}, (key, outcomes)
    for text in NOT_DURATIONS:
        refused = value(f"'{text}'")
        assert isinstance(refused, PolicyError) and refused.errors[0].startswith("p.yaml:"), (key, text, refused)


@pytest.mark.parametrize("ctype", sorted(t.name for t in CONDITION_TYPES.values() if t.kind == SIZE))
def test_every_policy_size_takes_the_size_grammar_and_refuses_a_bare_number(ctype):
    holder = _holder(ctype, "4GiB")
    for text, size in SIZES.items():
        loaded = _load(holder.replace("{COND}", _condition_key(ctype, f"'{text}'")))
        assert not isinstance(loaded, PolicyError), (ctype, text, loaded)
        assert loaded.rules[0].conditions[0].value == size, (ctype, text)
    for text in (*NOT_SIZES, "8", "0.5MiB"):
        for written in (text, f"'{text}'"):
            refused = _load(holder.replace("{COND}", _condition_key(ctype, written)))
            assert isinstance(refused, PolicyError), (ctype, written)
            assert refused.errors[0].startswith("p.yaml:"), refused.errors
    bare = _load(holder.replace("{COND}", _condition_key(ctype, "8")))
    assert "a bare number is not a size: 8 (write a unit: 8GiB, 8GB, 512MiB, 4096B)" in bare.errors[0]
    tiny = _load(holder.replace("{COND}", _condition_key(ctype, "0.5MiB")))
    assert "under 1 MiB, likely a mistake" in tiny.errors[0]
    assert _load(holder.replace("{COND}", _condition_key(ctype, "512KiB"))).rules[0].conditions[0].value == 512 << 10
