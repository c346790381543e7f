"""The kill grace has one limit (gpukill.limits.MAX_GRACE): the CLI, the kill path and the policy parser each
accept it and refuse just past it, so the CLI never sends what the daemon refuses, nor refuses what it takes."""

from __future__ import annotations

import argparse

import pytest

from gpukill.errors import InvalidArgs
from gpukill.limits import MAX_GRACE
from gpukill.policy import PolicyError, load_texts
from gpukillctl.cli.main import seconds
from gpukilld.acts.killer import check_grace

JUST_PAST = MAX_GRACE + 0.5


def policy_kill_grace(value: float) -> float:
    return load_texts([("p.yaml", f"kill_grace: {value!r}\nrules: []\n")]).settings.kill_grace


def rule_kill_grace(value: float) -> float | None:
    text = (
        "rules:\n  - name: r\n    action: kill\n    kill_grace: " + repr(value) + "\n"
        "    conditions: [{type: process_name, operator: ==, value: x}]\n"
    )
    return load_texts([("p.yaml", text)]).rules[0].kill_grace


def test_the_cli_takes_the_limit_and_refuses_past_it():
    assert seconds(repr(MAX_GRACE)) == MAX_GRACE
    with pytest.raises(argparse.ArgumentTypeError, match=f"between 0 and {MAX_GRACE:g} seconds"):
        seconds(repr(JUST_PAST))


def test_the_kill_path_takes_the_limit_and_refuses_past_it():
    assert check_grace(MAX_GRACE) == MAX_GRACE
    with pytest.raises(InvalidArgs, match=f"between 0 and {MAX_GRACE:g} seconds"):
        check_grace(JUST_PAST)


@pytest.mark.parametrize("read", [policy_kill_grace, rule_kill_grace])
def test_a_policy_takes_the_limit_and_refuses_past_it(read):
    assert read(MAX_GRACE) == MAX_GRACE
    with pytest.raises(PolicyError, match="kill_grace must be between 0s and"):
        read(JUST_PAST)
