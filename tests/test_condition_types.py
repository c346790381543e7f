"""The registry of condition types is the one place a type is declared (gpukill/condition_types.py).

For every registered type, from its declaration alone: the parser takes it in each scope it declares (in the
role declared) and refuses it in the others with its "needs" message at FILE:LINE:COL; it takes exactly the
operators declared; the engine compiles and evaluates it in each scope, writes its value in reasons with the
type's printer (or, without one, never the text it matched), and picks victims in the order the types imply;
docs/guard.md's condition table lists exactly the registered types; and neither the parser nor the engine
spells a type's name.
"""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
from helpers.guard_inputs import OWN_PID, FakeGroups, FakeTime, GiB, dev, proc, snap
from helpers.testbed import REPO

from gpukill.condition_types import (
    CELSIUS,
    CONDITION_TYPES,
    COUNT,
    DURATION,
    GROUP,
    INDEX,
    KINDS,
    LIST_OPS,
    NUMBER_OPS,
    ON_PROCESS,
    OPERATORS,
    PERCENT,
    SIZE,
    STRING,
    STRING_OPS,
    USER,
    VICTIM_ORDERS,
    ConditionType,
    view_of,
)
from gpukill.policy import PolicyError, load_texts
from gpukill.rules import SCOPES, SELECTOR, Condition
from gpukilld.guard.engine import Engine, KillOrder, Preview

# A value of each kind as a policy writes it: a kind added without one here fails every test below.
SAMPLE = {
    STRING: "x",
    USER: "alice",
    GROUP: "video",
    PERCENT: 50,
    CELSIUS: 80,
    SIZE: "1GiB",
    DURATION: "5m",
    COUNT: 3,
    INDEX: 0,
}
# For the engine: a condition that holds for the snapshot below and one that cannot, per kind.
HOLDS = {
    STRING: ("!=", "no-such-value"),
    USER: ("!=", "no-such-user"),
    GROUP: ("!=", "no-such-group"),
    PERCENT: (">=", 0),
    CELSIUS: (">=", -273),
    SIZE: (">=", "0B"),
    DURATION: (">=", 0),
    COUNT: (">=", 0),
    INDEX: ("==", 0),
}
NEVER = {
    STRING: ("==", "no-such-value"),
    USER: ("==", "no-such-user"),
    GROUP: ("==", "no-such-group"),
    PERCENT: ("<", 0),
    CELSIUS: ("<", -273),
    SIZE: ("<", "0B"),
    DURATION: ("<", 0),
    COUNT: ("<", 0),
    INDEX: ("!=", 0),
}
SECRET = "--token=s3cr3t"  # in the process's command line: no reason may carry it
# What a reason shows of the snapshot below, for each type with a printer.
SHOWN = {
    "user": "'alice'",
    "gpu_utilization": "60%",
    "gpu_memory": "2.0 GiB",
    "runtime": "16min 39s",
    "user_memory": "2.0 GiB",
    "device_memory": "2.0 GiB",
    "temperature": "70°C",
    "device_state": "'ok'",
    "state_reason": "'Xid 79; recovery action: GPU reset'",
    "recovery_action": "'GPU reset'",
    "rogue_score": "0",
    "rogue_kind": "''",
    "gpu": "0",
    "user_utilization": "60%",
    "user_processes": "1",
    "group_memory": "2.0 GiB",
    "group_utilization": "60%",
    "group_processes": "1",
    "device_memory_free": "78.0 GiB",
}
XID = "Xid 79; recovery action: GPU reset"  # the device's state_reason below (gpukill.device_faults)
PAIRS = [(name, scope) for name in CONDITION_TYPES for scope in SCOPES]


def rule_text(type_name: str, scope: str, op: str, value: object, action: str = "log") -> str:
    return (
        "rules:\n"
        "  - name: r\n"
        f"    scope: {scope}\n"
        f"    action: {action}\n"
        "    conditions:\n"
        f"      - type: {type_name}\n"  # line 6, the type's value at column 15
        f"        operator: '{op}'\n"
        f"        value: {value!r}\n"
        # per_group looks at the groups its group condition names (gpukill.condition_types: names)
        + ("      - {type: group, operator: ==, value: video}\n" if scope == "per_group" else "")
    )


def value_for(ctype: ConditionType, op: str) -> object:
    """A value the parser takes: the kind's sample, or the first of a closed set of values."""
    sample = ctype.values[0] if ctype.values else SAMPLE[ctype.kind]
    return [sample] if op in LIST_OPS else sample


def holds(ctype: ConditionType) -> tuple[str, object]:
    """HOLDS for its kind; for a closed set of values, not its last (the device below is "ok")."""
    return ("!=", ctype.values[-1]) if ctype.values else HOLDS[ctype.kind]


def never(ctype: ConditionType) -> tuple[str, object]:
    return ("==", ctype.values[-1]) if ctype.values else NEVER[ctype.kind]


@pytest.mark.parametrize(("type_name", "scope"), PAIRS)
def test_the_parser_takes_a_type_in_its_scopes_and_refuses_it_in_the_others(type_name: str, scope: str) -> None:
    ctype = CONDITION_TYPES[type_name]
    op = ctype.operators[0]
    text = rule_text(type_name, scope, op, value_for(ctype, op))
    if scope in ctype.roles:
        (rule,) = load_texts([("p.yaml", text)]).rules
        assert (rule.scope, rule.conditions[0].type, rule.conditions[0].role) == (scope, type_name, ctype.roles[scope])
    else:
        with pytest.raises(PolicyError) as info:
            load_texts([("p.yaml", text)])
        assert info.value.errors == [f"p.yaml:6:15: {ctype.needs} (the rule's scope is {scope})"]


@pytest.mark.parametrize("type_name", CONDITION_TYPES)
def test_the_parser_takes_exactly_the_operators_a_type_declares(type_name: str) -> None:
    ctype = CONDITION_TYPES[type_name]
    scope = next(iter(ctype.roles))
    for op in OPERATORS:
        text = rule_text(type_name, scope, op, value_for(ctype, op))
        if op in ctype.operators:
            assert load_texts([("p.yaml", text)]).rules[0].conditions[0].operator == op
        else:
            with pytest.raises(PolicyError) as info:
                load_texts([("p.yaml", text)])
            assert info.value.errors == [
                f"p.yaml:7:19: operator {op!r} does not fit {type_name} (use one of: {', '.join(ctype.operators)})"
            ]


def previews(type_name: str, scope: str, op: str, value: object) -> tuple[list[Preview], Condition]:
    """What the engine previews for a one-condition rule on one process (started 999 s ago) on one device."""
    policy = load_texts([("p.yaml", rule_text(type_name, scope, op, value))])
    engine = Engine(policy, clock=FakeTime().clock(), groups=FakeGroups({1000: {"video"}}), own_pid=OWN_PID)
    p = proc(
        500, "trainer", mem=2 * GiB, util=60.0, unit="job.service", container="c0ffee", cmdline=f"trainer {SECRET}"
    )
    device = dataclasses.replace(dev(0, temperature=70.0, util=60.0, used=2 * GiB), state_reason=XID)
    found = engine.preview(snap(p, devices=(device,)))
    return found, policy.rules[0].conditions[0]


@pytest.mark.parametrize(("type_name", "scope"), [(n, s) for n, s in PAIRS if s in CONDITION_TYPES[n].roles])
def test_the_engine_compiles_and_evaluates_each_type_in_each_of_its_scopes(type_name: str, scope: str) -> None:
    ctype = CONDITION_TYPES[type_name]
    # A per_device rule with only selectors holds for every device: then it counts no process.
    assert [p.pids for p in previews(type_name, scope, *never(ctype))[0]] in ([], [()])
    (preview,), cond = previews(type_name, scope, *holds(ctype))
    assert preview.pids == (500,) and SECRET not in preview.reason
    if scope == "per_group":  # the group condition rule_text adds holds, and says so
        parts = preview.reason.split("; ")
        parts.remove("group == video")
        preview = dataclasses.replace(preview, reason="; ".join(parts))
    if cond.role == SELECTOR:  # it picks the processes the rule counts
        assert preview.reason == f"counting 1 process(es) with {cond.text}"
    elif ctype.printer is None:  # the condition, never the text it matched
        assert preview.reason == cond.text
    else:  # the value read, as the type's printer writes it, then the condition it met
        assert preview.reason == f"{type_name} {SHOWN[type_name]} {cond.text.removeprefix(type_name + ' ')}"


def test_a_value_the_backend_cannot_read_is_written_unknown() -> None:
    for ctype in CONDITION_TYPES.values():
        if ctype.printer is not None:
            op = ctype.operators[0]
            text = rule_text(ctype.name, next(iter(ctype.roles)), op, value_for(ctype, op))
            (rule,) = load_texts([("p.yaml", text)]).rules
            assert ctype.describe(rule.conditions[0], None).startswith(f"{ctype.name} unknown {op} ")


def test_victims_go_largest_first_in_the_order_the_types_imply() -> None:
    """A device over 50% utilization: by utilization, stopping the busiest process is enough; by memory, the
    largest (and idle) one would go first, and the device would still be over."""
    clock = FakeTime()
    text = (
        "rules:\n  - name: hot\n    scope: per_device\n    action: kill\n"
        "    conditions: [{type: gpu_utilization, operator: '>', value: 50}]\n"
    )
    engine = Engine(load_texts([("p.yaml", text)]), clock=clock.clock(), groups=FakeGroups({}), own_pid=OWN_PID)
    big_idle, small_busy = proc(10, mem=10 * GiB, util=10.0), proc(11, mem=1 * GiB, util=60.0)
    events = engine.evaluate(snap(big_idle, small_busy, devices=(dev(0, util=70.0, used=11 * GiB),)), False)
    (order,) = [e for e in events if isinstance(e, KillOrder)]
    assert [t.pid for t in order.targets] == [11]


@pytest.mark.parametrize("type_name", CONDITION_TYPES)
def test_a_declaration_is_complete(type_name: str) -> None:
    """What the parser and the engine rely on, declared: readers for every view the roles lead to, a reason
    for every scope left out, an indexed type read by name, known kinds, operators and orders."""
    t = CONDITION_TYPES[type_name]
    assert t.kind in KINDS and t.victim_order in (*VICTIM_ORDERS, None)
    textual = t.kind in (STRING, USER, GROUP)
    assert set(t.operators) <= set(STRING_OPS if textual else NUMBER_OPS)  # what the engine can compare
    assert t.share is None or not textual
    assert set(t.reads) == {view_of(scope, role) for scope, role in t.roles.items()}
    assert set(t.roles) <= set(SCOPES) and bool(t.needs) == (set(t.roles) != set(SCOPES))
    assert set(t.lower_bound_on) <= set(t.reads)
    assert not t.indexed or isinstance(t.reads[ON_PROCESS], str)


def test_the_readme_condition_table_lists_exactly_the_registered_types() -> None:
    readme = (REPO / "docs" / "guard.md").read_text()
    table = readme[readme.index("| condition `type` |") :]
    rows = table[: table.index("\n\n")].splitlines()[2:]
    documented = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])]
    assert sorted(documented) == sorted(CONDITION_TYPES)


@pytest.mark.parametrize(
    "module",
    [
        *sorted(str(p.relative_to(REPO)) for p in (REPO / "gpukill" / "policy").glob("*.py")),
        "gpukill/rules.py",
        "gpukilld/guard/conditions.py",
        "gpukilld/guard/engine.py",
    ],
)
def test_the_parser_and_the_engine_never_name_a_type(module: str) -> None:
    """A type's name in them would be a decision about that type made outside the registry."""
    tree = ast.parse((REPO / module).read_text())
    named = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in CONDITION_TYPES})
    assert named == []


@pytest.mark.parametrize(
    ("type_name", "scope", "value", "error"),
    [
        (
            "user_processes",
            "per_user",
            2.5,
            "the value of user_processes > must be a whole number from 0 to 1000000, not the number 2.5",
        ),
        (
            "user_processes",
            "per_user",
            True,
            "the value of user_processes > must be a whole number from 0 to 1000000, not true",
        ),
        (
            "gpu",
            "per_process",
            1024,
            "the value of gpu > must be a GPU index (a whole number) from 0 to 1023, not the number 1024",
        ),
        (
            "gpu",
            "per_device",
            "0",
            "the value of gpu > must be a GPU index (a whole number) from 0 to 1023, not the string '0'",
        ),
    ],
)
def test_counts_and_gpu_indexes_are_whole_numbers_in_range(type_name, scope, value, error) -> None:
    op = "==" if type_name == "gpu" else ">"
    with pytest.raises(PolicyError) as info:
        load_texts([("p.yaml", rule_text(type_name, scope, op, value))])
    assert info.value.errors == [f"p.yaml:8:16: {error.replace('gpu >', 'gpu ==')}"]
