"""gpu-kill's user, group and GPU policies as records (gpukill/managed_policy.py), rendered into ordinary Guard
policy files: settings refused in one line, every rendering valid and read back to its record, hand edits
seen, exports round-tripped byte for byte, import errors at NAME:LINE:COL; and what the rendered files make
the engine do (no daemon: an injected clock and snapshots, as tests/test_guard_engine.py)."""

from __future__ import annotations

import itertools

import pytest
from helpers.guard_inputs import OWN_PID, FakeGroups, FakeTime, GiB, dev, proc, snap
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpukill.errors import InvalidArgs
from gpukill.managed_policy import (
    APPLIES,
    KINDS,
    LIMITS,
    SETTINGS,
    ManagedPolicy,
    as_settings,
    edited,
    export_text,
    file_name,
    import_text,
    parse_settings,
    read_file,
    render,
)
from gpukill.policy import PolicyError, load_texts, parse_file_text
from gpukilld.guard.engine import Engine, KillOrder, Violation

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", fullmatch=True)
VALUES = {
    "memory_limit": st.integers(1, 2**60),
    "reserved_memory": st.integers(1, 2**60),
    "utilization_limit": st.floats(0, 100, allow_nan=False) | st.integers(0, 100),
    "process_limit": st.integers(0, 1_000_000),
    "allowed_users": st.lists(NAMES, min_size=1, max_size=5),
    "grace": st.floats(0, 86400, allow_nan=False),
}


@st.composite
def policies(draw) -> ManagedPolicy:
    kind = draw(st.sampled_from(KINDS))
    target = str(draw(st.integers(0, 1023))) if kind == "gpu" else draw(NAMES)
    keys = [k for k in APPLIES[kind] if k in LIMITS]
    chosen = draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))
    if draw(st.booleans()):
        chosen.append("grace")
    return parse_settings(kind, target, {k: draw(VALUES[k]) for k in chosen})


# -- parse_settings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "target", "given", "error"),
    [
        (
            "user",
            "alice",
            {"memory_limt": 1},
            "unknown setting 'memory_limt' (known: memory_limit, utilization_limit, "
            "process_limit, allowed_users, reserved_memory, grace)",
        ),
        (
            "user",
            "alice",
            {"memory_limit": 1, "allowed_users": ["bob"]},
            "allowed_users does not apply to a user policy"
            " (it takes: memory_limit, utilization_limit, process_limit, grace)",
        ),
        (
            "gpu",
            "0",
            {"process_limit": 2},
            "process_limit does not apply to a gpu policy (it takes: memory_limit, utilization_limit, allowed_users, "
            "reserved_memory, grace)",
        ),
        (
            "user",
            "al ice",
            {"memory_limit": 1},
            "bad user name 'al ice': a letter or _ first, then letters, digits, _ . or -, at most 32 characters",
        ),
        (
            "user",
            "1000",
            {"memory_limit": 1},
            "bad user name '1000': a letter or _ first, then letters, digits, _ . or -, at most 32 characters",
        ),
        (
            "group",
            "../etc",
            {"memory_limit": 1},
            "bad group name '../etc': a letter or _ first, then letters, digits, _ . or -, at most 32 characters",
        ),
        ("gpu", "1024", {"memory_limit": 1}, "GPU index '1024' is out of range: a whole number from 0 to 1023"),
        ("gpu", "-1", {"memory_limit": 1}, "GPU index '-1' is out of range: a whole number from 0 to 1023"),
        ("gpu", "01", {"memory_limit": 1}, "GPU index '01' is out of range: a whole number from 0 to 1023"),
        ("disk", "0", {"memory_limit": 1}, "unknown policy kind 'disk' (known: user, group, gpu)"),
        (
            "user",
            "alice",
            {},
            "a user policy needs at least one limit (memory_limit, utilization_limit, process_limit)",
        ),
        (
            "user",
            "alice",
            {"grace": 5.0},
            "a user policy needs at least one limit (memory_limit, utilization_limit, process_limit)",
        ),
        (
            "gpu",
            "0",
            {"allowed_users": []},
            "a gpu policy needs at least one limit (memory_limit, utilization_limit, allowed_users, reserved_memory)",
        ),
        (
            "user",
            "alice",
            {"memory_limit": True},
            "memory_limit must be a whole number of bytes from 1 to 2^60 (1 EiB), not True",
        ),
        (
            "user",
            "alice",
            {"memory_limit": 0},
            "memory_limit must be a whole number of bytes from 1 to 2^60 (1 EiB), not 0",
        ),
        (
            "user",
            "alice",
            {"memory_limit": "8"},
            "memory_limit: a bare number is not a size: '8' (write a unit: 8GiB, 8GB, 512MiB, 4096B)",
        ),
        (
            "user",
            "alice",
            {"memory_limit": "0.5MiB"},
            "memory_limit: a limit of '0.5MiB' is under 1 MiB, likely a "
            "mistake (every GPU process holds more); write it in B or KiB "
            "(e.g. 4096B, 512KiB) if it is meant",
        ),
        (
            "user",
            "alice",
            {"grace": "5 parsecs"},
            "grace: not a duration: '5 parsecs' (write e.g. 90s, 5min, 1h30m, 2d 4h; units ms, s, min, h, d, w)",
        ),
        ("user", "alice", {"utilization_limit": 101.0}, "utilization_limit must be from 0 to 100 (percent), not 101.0"),
        (
            "user",
            "alice",
            {"utilization_limit": float("nan")},
            "utilization_limit must be from 0 to 100 (percent), not nan",
        ),
        ("user", "alice", {"process_limit": 2.5}, "process_limit must be a whole number from 0 to 1000000, not 2.5"),
        ("user", "alice", {"memory_limit": 1, "grace": -1}, "grace must be from 0 to 86400 (seconds), not -1"),
        ("gpu", "0", {"allowed_users": "alice"}, "allowed_users must be a list of user names, not 'alice'"),
        (
            "gpu",
            "0",
            {"allowed_users": ["alice", "b b"]},
            "bad user name 'b b' in allowed_users: a letter or _ first, "
            "then letters, digits, _ . or -, at most 32 characters",
        ),
    ],
)
def test_parse_settings_refuses_bad_input_in_one_line(kind, target, given, error) -> None:
    with pytest.raises(InvalidArgs) as info:
        parse_settings(kind, target, given)
    assert str(info.value) == error and "\n" not in error


def test_a_callers_limit_takes_the_size_grammar_and_a_tiny_byte_count_is_refused() -> None:
    """Text in the one size grammar; a typed byte count (D-Bus 't') is bytes, but under 1 MiB only a text in
    B or KiB says it is meant. A record read back (a file's header) holds what was once accepted."""
    assert parse_settings("user", "alice", {"memory_limit": "8GiB"}, caller=True).memory_limit == 8 * GiB
    assert parse_settings("gpu", "0", {"reserved_memory": "512KiB"}, caller=True).reserved_memory == 512 << 10
    assert parse_settings("user", "alice", {"memory_limit": 8 * GiB, "grace": "2min"}, caller=True).grace == 120.0
    with pytest.raises(InvalidArgs, match="memory_limit: a limit of 8 is under 1 MiB, likely a mistake"):
        parse_settings("user", "alice", {"memory_limit": 8}, caller=True)
    assert parse_settings("user", "alice", {"memory_limit": 524288}).memory_limit == 524288  # read back
    p = parse_settings("gpu", "0", {"reserved_memory": "512KiB", "memory_limit": "1000000001B"}, caller=True)
    assert import_text(export_text([p]), "x.yaml") == [p]  # exported with units, read back exactly
    assert "reserved_memory: 512KiB" in export_text([p]) and "memory_limit: 1000000001B" in export_text([p])
    assert "value: 512KiB" in render(p) and load_texts([(file_name(p), render(p))])


def test_parse_settings_and_as_settings() -> None:
    p = parse_settings("gpu", "3", {"allowed_users": ["bob", "alice", "bob"], "reserved_memory": GiB})
    assert p == ManagedPolicy("gpu", "3", allowed_users=("alice", "bob"), reserved_memory=GiB, grace=30.0)
    assert as_settings(p) == {"allowed_users": ["alice", "bob"], "reserved_memory": GiB, "grace": 30.0}
    assert parse_settings("gpu", "3", as_settings(p)) == p
    assert file_name(p) == "60-managed-gpu-3.yaml"
    assert file_name(parse_settings("user", "alice", {"memory_limit": 1})) == "60-managed-user-alice.yaml"


def test_the_record_and_its_settings_agree() -> None:
    """as_settings, the export and the header follow SETTINGS: a field added to the record without it fails."""
    assert ManagedPolicy.__dataclass_fields__.keys() == {"kind", "target", *SETTINGS}


# -- render and read_file ---------------------------------------------------------------------------------

SAMPLE = {
    "memory_limit": 8 * GiB,
    "utilization_limit": 80.0,
    "process_limit": 2,
    "allowed_users": ["alice", "bob"],
    "reserved_memory": 2 * GiB,
}
TARGETS = {"user": "alice", "group": "research", "gpu": "0"}


def every_combination() -> list[ManagedPolicy]:
    out = []
    for kind in KINDS:
        limits = [k for k in APPLIES[kind] if k in LIMITS]
        for n in range(1, len(limits) + 1):
            for chosen in itertools.combinations(limits, n):
                for grace in (None, 0.0, 12.5):
                    given = {k: SAMPLE[k] for k in chosen} | ({} if grace is None else {"grace": grace})
                    out.append(parse_settings(kind, TARGETS[kind], given))
    return out


@pytest.mark.parametrize("p", every_combination(), ids=lambda p: f"{p.kind}-{'-'.join(as_settings(p))}")
def test_every_combination_renders_a_valid_policy_read_back_to_its_record(p: ManagedPolicy) -> None:
    text = render(p)
    policy = load_texts([(file_name(p), text)])
    set_limits = [k for k in LIMITS if getattr(p, k) not in (None, ())]
    assert len(policy.rules) == len(set_limits)  # one rule per limit, each a kill after the grace
    assert all(r.action == "kill" and r.grace_period == p.grace for r in policy.rules)
    assert all(r.name.startswith(f"{p.kind}-{TARGETS[p.kind]}-") for r in policy.rules)
    assert read_file(file_name(p), text) == p
    assert render(p) == text  # deterministic
    assert not edited(p, text)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(policies())
def test_any_policy_renders_valid_and_reads_back(p: ManagedPolicy) -> None:
    text = render(p)
    parse_file_text(text, file_name(p))
    assert read_file(f"/etc/gpukill/guard.d/{file_name(p)}", text) == p


def test_all_managed_files_together_are_one_valid_policy() -> None:
    ps = [
        parse_settings("user", "alice", {"memory_limit": GiB, "process_limit": 1}),
        parse_settings("user", "bob", {"utilization_limit": 50}),
        parse_settings("group", "alice", {"memory_limit": GiB}),  # a group named as a user: other rule names
        parse_settings("gpu", "0", {"allowed_users": ["alice"], "reserved_memory": GiB}),
        parse_settings("gpu", "1", {"memory_limit": GiB}),
    ]
    policy = load_texts([(file_name(p), render(p)) for p in ps])
    assert len({r.name for r in policy.rules}) == len(policy.rules) == 7


def test_read_file_knows_only_its_own_files() -> None:
    p = parse_settings("user", "alice", {"memory_limit": GiB})
    text = render(p)
    assert read_file("50-mine.yaml", "rules: []\n") is None
    assert read_file("60-managed-user-bob.yaml", text) is None  # a copy under another name is not managed
    assert read_file(file_name(p), text.replace('"memory_limit":1073741824', '"memory_limit":-1')) is None
    assert read_file(file_name(p), "# gpukill managed policy: {not json\nrules: []\n") is None


def test_edited_sees_a_hand_change() -> None:
    p = parse_settings("user", "alice", {"memory_limit": 8 * GiB, "grace": 30})
    text = render(p)
    assert not edited(p, text)
    by_hand = text.replace("value: 8GiB", "value: 16GiB")
    assert by_hand != text and load_texts([(file_name(p), by_hand)])  # still a valid policy
    assert read_file(file_name(p), by_hand) == p and edited(p, by_hand)  # the record stays; the file changed
    assert edited(p, text + "  # a comment\n")
    assert edited(p, text.replace("grace_period: 30.0", "grace_period: 1h"))


# -- export and import ------------------------------------------------------------------------------------


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(policies(), max_size=6, unique_by=lambda p: (p.kind, p.target)))
def test_export_import_export_is_byte_equal(ps: list[ManagedPolicy]) -> None:
    text = export_text(ps)
    back = import_text(text, "export.yaml")
    assert sorted(back, key=repr) == sorted(ps, key=repr)
    assert export_text(back) == text
    assert export_text(reversed(ps)) == text  # canonical: the order given does not matter


def test_import_reads_what_a_person_writes() -> None:
    text = (
        "policies:\n"
        "  - {kind: user, target: alice, memory_limit: 8GiB, grace: 1m}\n"
        "  - {kind: gpu, target: 0, utilization_limit: '90%', allowed_users: [bob]}\n"
    )
    assert import_text(text, "mine.yaml") == [
        ManagedPolicy("user", "alice", memory_limit=8 * GiB, grace=60.0),
        ManagedPolicy("gpu", "0", utilization_limit=90.0, allowed_users=("bob",)),
    ]
    assert import_text(export_text([]), "empty.yaml") == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "policies:\n  - kind: user\n    target: alice\n    memory_limt: 5\n",
            "in.yaml:4:5: unknown field 'memory_limt' in a policy (did you mean 'memory_limit'?) (known: kind, target, "
            "memory_limit, utilization_limit, process_limit, allowed_users, reserved_memory, grace)",
        ),
        (
            "policies:\n  - kind: user\n    target: alice\n    allowed_users: [bob]\n",
            "in.yaml:4:5: allowed_users does not apply to a user policy (it takes: memory_limit, utilization_limit, "
            "process_limit, grace)",
        ),
        (
            "policies:\n  - kind: gpu\n    target: 4096\n    memory_limit: 5\n",
            "in.yaml:3:13: GPU index '4096' is out of range: a whole number from 0 to 1023",
        ),
        (
            "policies:\n  - kind: usr\n    target: alice\n",
            "in.yaml:2:11: unknown policy kind 'usr' (known: user, group, gpu)",
        ),
        (
            "policies:\n  - kind: user\n    target: alice\n",
            "in.yaml:2:5: a user policy needs at least one limit (memory_limit, utilization_limit, process_limit)",
        ),
        (
            "policies:\n  - kind: user\n    target: alice\n    memory_limit: 8 gigs\n",
            "in.yaml:4:19: memory_limit: not a size: '8 gigs' (write a unit: 8GiB, 8GB, 512MiB, 4096B)",
        ),
        (
            "policies:\n  - kind: user\n    target: alice\n    memory_limit: 8589934592\n",
            "in.yaml:4:19: memory_limit: a bare number is not a size: 8589934592"
            " (write a unit: 8GiB, 8GB, 512MiB, 4096B)",
        ),
        (
            "policies:\n  - {kind: user, target: bob, memory_limit: 1GiB}\n"
            "  - {kind: user, target: bob, process_limit: 1}\n",
            "in.yaml:3:5: a second user policy for bob (first at in.yaml:2:5)",
        ),
        (
            "policies: [\n",
            "in.yaml:2:1: not valid YAML: while parsing a flow node expected the node content, but found "
            "'<stream end>'",
        ),
        ("rules: []\n", "in.yaml:1:1: unknown field 'rules' in the managed policies (known: policies)"),
    ],
)
def test_import_errors_name_file_line_and_column(text: str, error: str) -> None:
    with pytest.raises(PolicyError) as info:
        import_text(text, "in.yaml")
    assert info.value.errors[0] == error


def test_import_is_bounded_like_every_policy() -> None:
    with pytest.raises(PolicyError) as info:
        import_text("policies: []\n" + "#" * (1 << 20), "big.yaml")
    assert info.value.errors == ["big.yaml:1:1: the policy is larger than 1024 KiB"]


# -- what the rendered files make the engine do --------------------------------------------------------------


def engine_for(*ps: ManagedPolicy, t: FakeTime, groups: FakeGroups | None = None) -> Engine:
    policy = load_texts([(file_name(p), render(p)) for p in ps])
    return Engine(policy, t.clock(), groups=groups or FakeGroups({}), own_pid=OWN_PID)


def kill_orders(events) -> list[list[int]]:
    return [[x.pid for x in ev.targets] for ev in events if isinstance(ev, KillOrder)]


def after(engine: Engine, t: FakeTime, s, seconds: float) -> list:
    t.now += seconds
    return engine.evaluate(s, False)


def test_a_user_memory_limit_kills_the_users_largest_process_after_the_grace_and_not_before() -> None:
    t = FakeTime()
    e = engine_for(parse_settings("user", "alice", {"memory_limit": 8 * GiB, "grace": 30}), t=t)
    s = snap(
        proc(10, mem=5 * GiB),
        proc(11, mem=4 * GiB, device=1),
        proc(12, mem=1 * GiB),
        proc(20, mem=30 * GiB, uid=1001, user="bob"),
    )  # bob has no limit
    events = e.evaluate(s, False)
    assert [(type(ev).__name__, ev.subject) for ev in events] == [("Violation", "user alice")]
    assert "user_memory 10.0 GiB > 8GiB" in events[0].reason
    assert after(e, t, s, 29.9) == []  # not before the grace ends
    assert kill_orders(after(e, t, s, 0.1)) == [[10]]  # 10 GiB - 5 GiB: under, so the largest only


def test_a_user_process_limit_stops_the_surplus_only() -> None:
    t = FakeTime()
    e = engine_for(parse_settings("user", "alice", {"process_limit": 2, "grace": 0}), t=t)
    s = snap(
        proc(10, mem=1 * GiB),
        proc(11, mem=4 * GiB),
        proc(12, mem=3 * GiB, device=1),
        proc(13, mem=2 * GiB),
        *(proc(20 + i, uid=1001, user="bob") for i in range(5)),
    )
    events = e.evaluate(s, False)
    assert "user_processes 4 > 2" in next(ev for ev in events if isinstance(ev, Violation)).reason
    assert kill_orders(events) == [[11, 12]]  # the two largest; two stay, as the limit says


def test_a_user_utilization_limit_compares_the_users_share_of_each_gpu() -> None:
    t = FakeTime()
    e = engine_for(parse_settings("user", "alice", {"utilization_limit": 80, "grace": 0}), t=t)
    spread = snap(proc(10, util=50.0), proc(11, util=40.0, device=1))  # 50% of GPU 0, 40% of GPU 1
    assert e.evaluate(spread, False) == []
    crowded = snap(proc(10, util=50.0), proc(11, util=40.0), proc(12, util=5.0))  # 95% of GPU 0
    assert kill_orders(after(e, t, crowded, 1)) == [[10]]  # 45% left


def test_a_gpu_allowed_users_policy_stops_only_others_processes_on_that_gpu() -> None:
    t = FakeTime()
    e = engine_for(parse_settings("gpu", "0", {"allowed_users": ["alice"], "grace": 10}), t=t)
    s = snap(
        proc(10),
        proc(11, device=1),  # alice's: allowed
        proc(20, uid=1001, user="bob"),
        proc(21, uid=1001, user="bob", device=1),  # bob on 0, and on 1
        proc(30, uid=1002, user="carol", device=1),
        proc(30, uid=1002, user="carol", device=0),  # on both
        proc(40, uid=0, user="root"),
    )  # a system account: never touched
    events = e.evaluate(s, False)
    assert sorted(ev.subject for ev in events) == ["PID 20 (python, user bob)", "PID 30 (python, user carol)"]
    assert after(e, t, s, 9) == []
    assert sorted(pid for order in kill_orders(after(e, t, s, 1)) for pid in order) == [20, 30]


def test_reserved_memory_stops_processes_until_the_reservation_is_free_again() -> None:
    t = FakeTime()
    devices = (dev(0, used=75 * GiB), dev(1, used=79 * GiB))  # 80 GiB each: 5 GiB free on 0, 1 GiB on 1
    s = snap(
        proc(10, mem=30 * GiB),
        proc(20, mem=25 * GiB, uid=1001, user="bob"),
        proc(21, mem=4 * GiB, uid=1001, user="bob"),
        proc(22, mem=79 * GiB, uid=1001, user="bob", device=1),
        devices=devices,
    )
    e = engine_for(parse_settings("gpu", "0", {"reserved_memory": 10 * GiB, "grace": 0}), t=t)
    assert kill_orders(e.evaluate(s, False)) == [[10]]  # the largest on GPU 0; GPU 1 has no reservation
    shielded = engine_for(
        parse_settings("gpu", "0", {"reserved_memory": 10 * GiB, "allowed_users": ["alice"], "grace": 0}), t=t
    )
    # bob may not use GPU 0: the allowed-users rule stops both of his processes there; with those on their way
    # the reservation is kept (34 GiB free), so it stops nothing more, and never alice's
    assert kill_orders(shielded.evaluate(s, False)) == [[20], [21]]
    alone = snap(proc(10, mem=30 * GiB), proc(11, mem=40 * GiB), devices=(dev(0, used=75 * GiB),))
    later = engine_for(
        parse_settings("gpu", "0", {"reserved_memory": 10 * GiB, "allowed_users": ["alice"], "grace": 0}), t=t
    )
    events = later.evaluate(alone, False)
    assert [ev.subject for ev in events] == ["GPU 0 (GPU-0)"] and kill_orders(events) == []  # short, said so


def test_a_group_limit_is_the_members_total() -> None:
    t = FakeTime()
    groups = FakeGroups({1000: {"research"}, 1001: {"research", "staff"}, 0: {"research"}})
    e = engine_for(parse_settings("group", "research", {"memory_limit": 8 * GiB, "grace": 5}), t=t, groups=groups)
    s = snap(
        proc(10, mem=5 * GiB),
        proc(20, mem=4 * GiB, uid=1001, user="bob"),  # 9 GiB together, each under 8
        proc(30, mem=40 * GiB, uid=1002, user="carol"),  # not a member
        proc(40, mem=60 * GiB, uid=0, user="root"),
    )  # a member, but a system account: never counted
    events = e.evaluate(s, False)
    assert [ev.subject for ev in events] == ["group research"]
    assert "group_memory 9.0 GiB > 8GiB" in events[0].reason
    assert after(e, t, s, 4.9) == []
    assert kill_orders(after(e, t, s, 0.1)) == [[10]]  # the group's largest, then 4 GiB: under


def test_a_group_process_limit_counts_every_members_processes() -> None:
    t = FakeTime()
    groups = FakeGroups({1000: {"research"}, 1001: {"research"}})
    e = engine_for(parse_settings("group", "research", {"process_limit": 2, "grace": 0}), t=t, groups=groups)
    s = snap(
        proc(10, mem=1 * GiB),
        proc(11, mem=3 * GiB),
        proc(20, mem=2 * GiB, uid=1001, user="bob"),
        proc(30, mem=9 * GiB, uid=1002, user="carol"),
        proc(31, uid=1002, user="carol"),
    )
    assert kill_orders(e.evaluate(s, False)) == [[11]]  # three members' processes: the largest goes


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.text(
        alphabet=st.sampled_from("policies:-kindtargetusergpumemory_limitgrace 0123456789[]{},'\"\n&*!#%"), max_size=300
    )
)
def test_import_of_any_text_answers_policies_or_a_policy_error(text: str) -> None:
    try:
        got = import_text(text, "any.yaml")
    except PolicyError as e:
        assert e.errors and all(line.startswith("any.yaml:") and "\n" not in line for line in e.errors[:-1])
    else:
        assert all(isinstance(p, ManagedPolicy) for p in got)


def test_a_group_utilization_limit_adds_up_the_members_on_each_gpu() -> None:
    t = FakeTime()
    groups = FakeGroups({1000: {"research"}, 1001: {"research"}})
    e = engine_for(parse_settings("group", "research", {"utilization_limit": 80, "grace": 0}), t=t, groups=groups)
    s = snap(
        proc(10, util=50.0),
        proc(20, util=40.0, uid=1001, user="bob"),  # 90% of GPU 0 together
        proc(21, util=70.0, uid=1001, user="bob", device=1),
    )  # 70% of GPU 1: under
    # the one taking most of GPU 0 (bob's 70% on GPU 1 would bring GPU 0 down by nothing): 40% left there
    assert kill_orders(e.evaluate(s, False)) == [[10]]


def test_a_gpu_memory_and_utilization_limit_look_at_that_gpu_only() -> None:
    t = FakeTime()
    e = engine_for(parse_settings("gpu", "1", {"memory_limit": 40 * GiB, "utilization_limit": 90, "grace": 0}), t=t)
    devices = (dev(0, used=79 * GiB, util=100.0), dev(1, used=50 * GiB, util=95.0))
    s = snap(
        proc(10, mem=79 * GiB, util=100.0),  # GPU 0: over both, but it has no policy
        proc(20, mem=30 * GiB, util=10.0, device=1, uid=1001, user="bob"),
        proc(21, mem=20 * GiB, util=85.0, device=1, uid=1002, user="carol"),
        devices=devices,
    )
    events = e.evaluate(s, False)
    assert sorted(ev.rule.name for ev in events if isinstance(ev, Violation)) == ["gpu-1-memory", "gpu-1-utilization"]
    # the largest by memory goes (20 GiB left in use); with it on its way GPU 1 is at 85%: nothing more to stop
    assert kill_orders(events) == [[20]]
