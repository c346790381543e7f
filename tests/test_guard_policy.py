"""Guard policy files: the admins' policy loads as is, and broken files are reported as FILE:LINE:COL.

No daemon here: gpukill.policy is what `gpukillctl guard validate` runs offline, and what LoadPolicy runs before
anything is swapped. Every broken file is checked for the exact line and column of the mistake.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers.testbed import PYTHON, REPO

from gpukill.policy import PolicyError, load_paths, load_texts
from gpukill.rules import PER_PROCESS, PER_USER
from gpukill.units import parse_duration

FIRST_POLICY = REPO / "tests" / "guard_policies" / "first-policy.yaml"
EXAMPLE = REPO / "examples" / "guard.yaml"


def readme_guard_policy() -> str:
    """The policy docs/guard.md (the Guard Mode page) shows admins (its first yaml block)."""
    page = (REPO / "docs" / "guard.md").read_text()
    assert page.startswith("# Guard Mode\n")
    section = page.split("\n", 1)[1]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_the_guard_page_shows_the_first_policy_the_tests_load():
    """first-policy.yaml is the policy admins paste first, byte for byte (it must load as is):
    docs/guard.md must show that very text, so what admins copy is what this suite loads and runs."""
    assert readme_guard_policy() == FIRST_POLICY.read_text()


def test_the_first_policy_loads_as_is_with_and_by_default():
    policy = load_paths([str(FIRST_POLICY)])
    miners, memory = policy.rules
    assert miners.name == "block-crypto-miners" and memory.name == "limit-user-memory"
    # "Terminate processes with miner-like names OR high compute load" says the description; the rule is AND
    assert miners.match == "all" and miners.scope == PER_PROCESS
    assert [c.type for c in miners.conditions] == ["process_name", "gpu_utilization"]
    assert miners.conditions[0].value == ("xmrig", "ethminer", "cpuminer")
    assert miners.conditions[1].value == 95 and miners.conditions[1].duration == 300.0
    assert miners.force and miners.grace_period == 0 and miners.notify == ("admin@company.com",)
    # the condition's scope makes the rule per_user: only the largest processes are killed
    assert memory.scope == PER_USER and memory.conditions[0].value == 8 * 1024**3
    assert not memory.force and memory.grace_period == 30.0 and memory.notify is None


def test_the_example_is_the_first_policy_with_comments():
    """examples/guard.yaml explains AND-by-default around the same two rules, which must mean the same."""
    example = load_paths([str(EXAMPLE)])
    first = load_paths([str(FIRST_POLICY)])
    assert [r.fingerprint for r in example.rules[:2]] == [r.fingerprint for r in first.rules]
    text = EXAMPLE.read_text()
    assert "match: any" in text and "AND" in text


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90s", 90),
        ("5m", 300),
        ("1h30m", 5400),
        ("500ms", 0.5),
        (90, 90),
        (2.5, 2.5),
        ("1d", 86400),
        ("5 minutes", 300),
        ("5", 5),
        ("1h 30m", 5400),
        ("90min", 5400),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5 parsecs", "m", "-5m", "", "5m3", True, None, "1h 30"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_sizes_in_three_spellings():
    for value, expected in (("8589934592B", 8589934592), ('"8GiB"', 8 * 1024**3), ('"8GB"', 8 * 1000**3)):
        policy = load_texts(
            [
                (
                    "p.yaml",
                    _one_condition(f"type: user_memory\noperator: '>'\nvalue: {value}", rule_extra="scope: per_user"),
                )
            ]
        )
        assert policy.rules[0].conditions[0].value == expected


@pytest.mark.parametrize(
    ("value", "col", "message"),
    [
        ("8589934592", 16, "a bare number is not a size: 8589934592 (write a unit: 8GiB, 8GB, 512MiB, 4096B)"),
        ("'8'", 16, "a bare number is not a size: '8' (write a unit: 8GiB, 8GB, 512MiB, 4096B)"),
        ("0.5M", 16, "under 1 MiB, likely a mistake"),
    ],
)
def test_a_bare_or_tiny_size_fails_validation_where_it_is_written(value, col, message):
    text = (
        "rules:\n  - name: r\n    action: kill\n    scope: per_user\n    conditions:\n"
        f"      - type: user_memory\n        operator: '>'\n        value: {value}\n"
    )
    with pytest.raises(PolicyError) as e:
        load_texts([("p.yaml", text)])
    assert e.value.errors[0].startswith(f"p.yaml:8:{col}: ") and message in e.value.errors[0]
    assert len(e.value.errors) == 1


def _one_condition(condition: str, rule_extra: str = "", action: str = "kill") -> str:
    cond = textwrap.indent(condition, "        ").lstrip()
    extra = textwrap.indent(rule_extra, "    ") + "\n" if rule_extra else ""
    return f"rules:\n  - name: r\n    action: {action}\n{extra}    conditions:\n      - {cond}\n"


# (what is wrong, the file, "LINE:COL" of the mistake, a fragment of the message)
BROKEN = [
    ("YAML syntax: a tab", "rules:\n\t- name: x\n", "2:1", "not valid YAML"),
    ("YAML syntax: unclosed flow list", "rules: [\n  {name: x\n", "3:1", "not valid YAML"),
    ("empty file", "", "1:1", "empty"),
    ("top level is a list", "- rules\n", "1:1", "must be a mapping"),
    ("unknown top-level key", "rules: []\nrule: []\n", "2:1", "unknown field 'rule'"),
    ("no rules key", "dry_run: true\n", "1:1", "no 'rules:' list"),
    ("rules is a mapping", "rules:\n  name: x\n", "2:3", "'rules' must be a list"),
    ("a rule is a string", "rules:\n  - block miners\n", "2:5", "a rule must be a mapping"),
    (
        "unknown rule field",
        _one_condition("type: process_name\noperator: '=='\nvalue: x").replace(
            "    action: kill", "    action: kill\n    severity: high"
        ),
        "4:5",
        "unknown field 'severity'",
    ),
    (
        "missing rule name",
        "rules:\n  - action: kill\n    conditions:\n      - {type: exe, operator: '==', value: x}\n",
        "2:5",
        "needs a 'name'",
    ),
    (
        "rule name with a space",
        _one_condition("type: exe\noperator: '=='\nvalue: x").replace("name: r", "name: my rule"),
        "2:11",
        "rule name 'my rule'",
    ),
    (
        "duplicate rule names",
        "rules:\n"
        + "".join(
            f"  - name: same\n    action: log\n    conditions:\n      - {{type: exe, operator: '==', value: {v}}}\n"
            for v in "ab"
        ),
        "6:5",
        "duplicate rule name 'same' (first defined at bad.yaml:2:5)",
    ),
    ("no conditions", "rules:\n  - name: r\n    action: kill\n", "2:5", "needs 'conditions'"),
    (
        "empty conditions",
        "rules:\n  - name: r\n    action: kill\n    conditions: []\n",
        "4:17",
        "empty conditions list",
    ),
    (
        "unknown condition field",
        _one_condition("type: exe\noperater: '=='\nvalue: x"),
        "6:9",
        "unknown field 'operater' in a condition (did you mean 'operator'?)",
    ),
    (
        "unknown condition type",
        _one_condition("type: gpu_util\noperator: '>'\nvalue: 5"),
        "5:15",
        "unknown condition type 'gpu_util'",
    ),
    ("unknown operator", _one_condition("type: gpu_memory\noperator: '=>'\nvalue: 5"), "6:19", "unknown operator '=>'"),
    (
        "operator that does not fit the type",
        _one_condition("type: gpu_utilization\noperator: contains_any\nvalue: [9]"),
        "6:19",
        "does not fit gpu_utilization",
    ),
    (
        "number compared as a string",
        _one_condition("type: process_name\noperator: '>'\nvalue: 5"),
        "6:19",
        "operator '>' does not fit process_name",
    ),
    (
        "wrong value type",
        _one_condition("type: gpu_utilization\noperator: '>'\nvalue: high"),
        "7:16",
        "must be a number, not the string 'high'",
    ),
    (
        "a list where one value goes",
        _one_condition("type: process_name\noperator: '=='\nvalue: [a, b]"),
        "7:16",
        "must be a single value, not a list",
    ),
    ("percentage out of range", _one_condition("type: gpu_utilization\noperator: '>'\nvalue: 150"), "7:16", "0 to 100"),
    ("bad size", _one_condition("type: gpu_memory\noperator: '>'\nvalue: 8XB"), "7:16", "not a size: '8XB'"),
    (
        "bad duration",
        _one_condition("type: gpu_utilization\noperator: '>'\nvalue: 95\nduration: 5 parsecs"),
        "8:19",
        "not a duration: '5 parsecs'",
    ),
    (
        "negative duration",
        _one_condition("type: gpu_utilization\noperator: '>'\nvalue: 95\nduration: -5m"),
        "8:19",
        "not a duration",
    ),
    ("bad regex", _one_condition("type: cmdline\noperator: matches\nvalue: '([a-z'"), "7:16", "bad regular expression"),
    (
        "regex with a backreference (RE2)",
        _one_condition("type: cmdline\noperator: matches\nvalue: '(a)\\1'"),
        "7:16",
        "bad regular expression '(a)\\\\1': backreferences (\\1, (?P=name)) are not supported",
    ),
    (
        "regex with lookahead (RE2)",
        _one_condition("type: cmdline\noperator: matches\nvalue: 'x(?=y)'"),
        "7:16",
        "bad regular expression 'x(?=y)': lookahead and lookbehind",
    ),
    (
        "a number too large for any setting",
        _one_condition("type: gpu_memory\noperator: '>'\nvalue: " + "9" * 5000),
        "7:16",
        "a number written with more than 100 characters",
    ),
    (
        "a size beyond 1 EiB",
        _one_condition("type: gpu_memory\noperator: '>'\nvalue: 2EiB"),
        "7:16",
        "larger than the maximum, 1 EiB",
    ),
    (
        "an infinite percentage",
        _one_condition("type: gpu_utilization\noperator: '>'\nvalue: .inf"),
        "7:16",
        "must be from 0 to 100%, not inf",
    ),
    (
        "unknown action",
        _one_condition("type: exe\noperator: '=='\nvalue: x", action="terminate"),
        "3:13",
        "unknown action 'terminate'",
    ),
    (
        "force is not a boolean",
        _one_condition("type: exe\noperator: '=='\nvalue: x", rule_extra="force: 'yes'"),
        "4:12",
        "force must be true or false, not the string 'yes'",
    ),
    (
        "grace period on a notify rule",
        _one_condition(
            "type: exe\noperator: '=='\nvalue: x", action="notify", rule_extra="notify: [journal]\ngrace_period: 30s"
        ),
        "5:5",
        "grace_period applies only to actions kill, suspend, requeue and cancel",
    ),
    (
        "user_memory without per_user",
        _one_condition("type: user_memory\noperator: '>'\nvalue: 8GiB"),
        "5:15",
        "needs scope per_user",
    ),
    (
        "conflicting scopes",
        _one_condition(
            "type: user_memory\noperator: '>'\nvalue: 8GiB\nscope: per_user", rule_extra="scope: per_device"
        ),
        "9:16",
        "condition scope per_user conflicts with the rule's scope per_device",
    ),
    (
        "unknown scope",
        _one_condition("type: exe\noperator: '=='\nvalue: x", rule_extra="scope: per_node"),
        "4:12",
        "unknown scope 'per_node'",
    ),
    (
        "bad match",
        _one_condition("type: exe\noperator: '=='\nvalue: x", rule_extra="match: some"),
        "4:12",
        "match must be 'all' or 'any'",
    ),
    (
        "not a notify target",
        _one_condition("type: exe\noperator: '=='\nvalue: x", rule_extra="notify: [admin]"),
        "4:14",
        "not a notify target: 'admin'",
    ),
    (
        "webhook that is not http",
        _one_condition("type: exe\noperator: '=='\nvalue: x", rule_extra="notify: ['webhook:ftp://h/x']"),
        "4:14",
        "bad webhook URL",
    ),
    (
        "duplicate key",
        _one_condition("type: exe\noperator: '=='\nvalue: x\nvalue: y"),
        "8:9",
        "duplicate key 'value' in a condition (first at bad.yaml:7:9)",
    ),
    ("bad top-level setting", "dry_run: maybe\nrules: []\n", "1:10", "dry_run must be true or false"),
    ("max kills per cycle of zero", "max_kills_per_cycle: 0\nrules: []\n", "1:22", "from 1 to 10000"),
    (
        "unknown exemption",
        _one_condition("type: exe\noperator: '=='\nvalue: x", rule_extra="exemptions:\n  uids: [0]"),
        "5:7",
        "unknown field 'uids'",
    ),
    (
        "notify rule without targets",
        _one_condition("type: exe\noperator: '=='\nvalue: x", action="notify"),
        "2:5",
        "action notify but no notify targets",
    ),
    (
        "missing action",
        "rules:\n  - name: r\n    conditions:\n      - {type: exe, operator: '==', value: x}\n",
        "2:5",
        "needs an 'action'",
    ),
    (
        "duration on a process condition of a per_user rule",
        "rules:\n  - name: r\n    action: kill\n    scope: per_user\n    conditions:\n"
        "      - {type: user_memory, operator: '>', value: 1GiB}\n"
        "      - {type: process_name, operator: '==', value: x, duration: 5m}\n",
        "7:56",
        "duration on process_name is not supported in scope per_user",
    ),
    (
        "a per_user kill rule with only process conditions",
        "rules:\n  - name: r\n    action: kill\n    scope: per_user\n    conditions:\n"
        "      - {type: process_name, operator: '==', value: x}\n",
        "2:5",
        "with action kill it would stop every selected process",
    ),
]


@pytest.mark.parametrize("what, text, where, fragment", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_policy_is_reported_at_its_line_and_column(what, text, where, fragment):
    with pytest.raises(PolicyError) as info:
        load_texts([("bad.yaml", text)])
    first = info.value.errors[0]
    assert first.startswith(f"bad.yaml:{where}: "), (what, info.value.errors)
    assert fragment in first, (what, first)
    assert "\n" not in first


def test_at_least_twenty_kinds_of_broken_files():
    assert len({b[0] for b in BROKEN}) >= 20


def test_every_error_of_a_file_is_reported():
    text = (
        "rules:\n  - name: a\n    action: explode\n    conditions:\n      - {type: gpu_util, operator: '>', value: 1}\n"
        "  - name: b\n    action: kill\n    force: sometimes\n    conditions:\n"
        "      - {type: exe, operator: '==', value: x}\n"
    )
    with pytest.raises(PolicyError) as info:
        load_texts([("many.yaml", text)])
    assert [e.split(": ", 1)[0] for e in info.value.errors] == ["many.yaml:3:13", "many.yaml:5:16", "many.yaml:8:12"]
    assert str(info.value).endswith("(and 2 more; see gpukillctl guard validate)")


def test_rule_names_are_unique_across_files():
    one = "rules:\n  - {name: dup, action: log, conditions: [{type: exe, operator: '==', value: x}]}\n"
    with pytest.raises(PolicyError) as info:
        load_texts([("10-a.yaml", one), ("20-b.yaml", "\n" + one)])
    assert info.value.errors == ["20-b.yaml:3:5: duplicate rule name 'dup' (first defined at 10-a.yaml:2:5)"]


def test_later_files_override_settings_and_add_exemptions():
    a = "cooldown: 30s\nexemptions: {users: [root]}\nrules: []\n"
    b = "cooldown: 1m\nexemptions: {processes: [Xorg]}\nrules: []\n"
    policy = load_texts([("a.yaml", a), ("b.yaml", b)])
    assert policy.settings.cooldown == 60 and policy.settings.exemptions.users == ("root",)
    assert policy.settings.exemptions.processes == ("Xorg",)


def test_validate_from_the_cli_without_a_daemon(tmp_path: Path):
    """No bus in the environment at all: validate is offline; errors are FILE:LINE:COL, exit status 12."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN[16][1])  # unknown operator
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}
    r = subprocess.run(
        [PYTHON, "-m", "gpukillctl", "guard", "validate", str(bad)], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 12, r
    assert r.stderr == f"{bad}:6:19: unknown operator '=>' does not fit gpu_memory (use one of: >, >=, <, <=, ==, !=)\n"
    r = subprocess.run(
        [PYTHON, "-m", "gpukillctl", "guard", "validate", str(FIRST_POLICY), str(EXAMPLE.parent / "guard.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 12 and "duplicate rule name 'block-crypto-miners'" in r.stderr  # two files, one set
    r = subprocess.run(
        [PYTHON, "-m", "gpukillctl", "guard", "validate", str(FIRST_POLICY)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0 and "valid, 2 rule(s): block-crypto-miners, limit-user-memory" in r.stdout, r
    r = subprocess.run(
        [PYTHON, "-m", "gpukillctl", "guard", "validate", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 12 and r.stderr.endswith("missing.yaml:1:1: cannot read: No such file or directory\n")
    assert "Traceback" not in r.stderr


UNKNOWN_NAMES = """exemptions:
  users: [root, gpk-no-such-user-b]
  groups: [gpk-no-such-group]
rules:
  - name: alcie-memory
    conditions:
      - {type: user, operator: ==, value: gpk-no-such-user-a}
      - {type: gpu_memory, operator: ">", value: 8GiB}
    action: log
  - name: ids-and-known
    conditions:
      - {type: user, operator: in, value: [root, 4000000, gpk-no-such-user-a]}
    action: log
"""


def test_names_unknown_to_the_host_are_warnings_at_their_place():
    """A user or group name no one on this host has is a warning at FILE:LINE:COL, once per name (its first
    place); known names and numeric ids are not; the policy still loads (the user may be created later)."""
    from gpukill.policy import name_warnings

    policy = load_texts([("p.yaml", UNKNOWN_NAMES)])
    assert [r.name for r in policy.rules] == ["alcie-memory", "ids-and-known"]
    assert name_warnings(policy) == [
        "p.yaml:2:17: warning: no user 'gpk-no-such-user-b' on this host",
        "p.yaml:3:12: warning: no group 'gpk-no-such-group' on this host",
        "p.yaml:7:43: warning: no user 'gpk-no-such-user-a' on this host",
    ]
    assert name_warnings(load_texts([("q.yaml", FIRST_POLICY.read_text())])) == []
    # bounded: the first name (root) is looked up and known, the other three are counted
    assert name_warnings(policy, limit=1) == ["p.yaml: warning: 3 more user and group names not looked up"]


def test_validate_prints_the_warnings_and_succeeds(tmp_path: Path):
    policy = tmp_path / "names.yaml"
    policy.write_text(UNKNOWN_NAMES)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}
    r = subprocess.run(
        [PYTHON, "-m", "gpukillctl", "guard", "validate", str(policy)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == f"{policy}: valid, 2 rule(s): alcie-memory, ids-and-known\n", r
    assert r.stderr.splitlines() == [
        f"{policy}:2:17: warning: no user 'gpk-no-such-user-b' on this host",
        f"{policy}:3:12: warning: no group 'gpk-no-such-group' on this host",
        f"{policy}:7:43: warning: no user 'gpk-no-such-user-a' on this host",
    ]
