"""Policies from someone who means harm (every local user may send one with TestPolicies).

Whatever the text, the parser answers PolicyError with FILE:LINE:COL lines, never another exception, in
bounded time and with bounded output: numbers of any size, .inf and .nan, deep nesting, alias bombs, floods of
errors, huge strings, regular expressions that backtrack. And a guard.d broken that way never stops the
daemon: the runner keeps the last good policy and says why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cpu_time import cpu_time

from gpukill import policy as P
from gpukill.policy import (
    MAX_ERRORS,
    MAX_ITEMS,
    MAX_TEXT,
    TOO_MANY_ERRORS,
    PolicyError,
    grammar,
    load_texts,
    notify_target_problem,
    readers,
    values,
)
from gpukill.units import parse_duration, parse_size
from gpukilld.guard.conditions import string_test

MiB = 1 << 20
FAST = 2.0  # CPU seconds: a generous bound for anything a hostile policy can ask of the parser


def reject(text: str, name: str = "x.yaml") -> PolicyError:
    """The PolicyError the text gets, checked for what every rejection must be: quick, capped, one-line."""
    with cpu_time() as took, pytest.raises(PolicyError) as info:
        load_texts([(name, text)])
    errors = info.value.errors
    assert took.seconds < FAST, (took.seconds, errors[:3])
    assert 1 <= len(errors) <= MAX_ERRORS + 1
    for line in errors:
        assert "\n" not in line and len(line) <= P.MAX_ERROR_LINE, line[:200]
        assert line == TOO_MANY_ERRORS or line.startswith(f"{name}:"), line[:200]
    assert "\n" not in str(info.value)
    return info.value


def place(template: str, value: str) -> tuple[str, str]:
    """The template with value at '@', and the LINE:COL where the value starts."""
    i = template.index("@")
    line = template.count("\n", 0, i) + 1
    col = i - (template.rfind("\n", 0, i) + 1) + 1
    return template[:i] + value + template[i + 1 :], f"{line}:{col}"


def cond(type_: str, op: str = ">", scope: str = "per_process", extra: str = "") -> str:
    return (
        f"rules:\n  - name: r\n    action: log\n    scope: {scope}\n    conditions:\n"
        f"      - type: {type_}\n        operator: '{op}'\n{extra}"
    )


# Every numeric field of a policy: (field, template with '@' for the value, a valid value).
NUMERIC_FIELDS = [
    ("max_kills_per_cycle", "max_kills_per_cycle: @\nrules: []\n", "5"),
    ("sample_interval", "sample_interval: @\nrules: []\n", "5s"),
    ("cooldown", "cooldown: @\nrules: []\n", "5m"),
    ("kill_grace", "kill_grace: @\nrules: []\n", "10"),
    (
        "grace_period",
        "rules:\n  - name: r\n    action: kill\n    grace_period: @\n"
        "    conditions: [{type: exe, operator: ==, value: x}]\n",
        "30s",
    ),
    (
        "rule kill_grace",
        "rules:\n  - name: r\n    action: kill\n    kill_grace: @\n"
        "    conditions: [{type: exe, operator: ==, value: x}]\n",
        "5s",
    ),
    ("condition duration", cond("gpu_utilization", extra="        value: 95\n        duration: @\n"), "5m"),
    ("gpu_memory", cond("gpu_memory", extra="        value: @\n"), "8GiB"),
    ("user_memory", cond("user_memory", scope="per_user", extra="        value: @\n"), "8589934592B"),
    ("device_memory", cond("device_memory", scope="per_device", extra="        value: @\n"), "'90%'"),
    ("gpu_utilization", cond("gpu_utilization", extra="        value: @\n"), "95"),
    ("temperature", cond("temperature", scope="per_device", extra="        value: @\n"), "85"),
    ("runtime", cond("runtime", extra="        value: @\n"), "2h"),
    ("user uid", cond("user", "==", extra="        value: @\n"), "1000"),
    ("user uid list", cond("user", "in", extra="        value: [@]\n"), "1000"),
    ("group gid", cond("group", "==", extra="        value: @\n"), "1000"),
    ("exempt uid", "exemptions:\n  users: [@]\nrules: []\n", "1000"),
    ("exempt gid", "exemptions:\n  groups: [@]\nrules: []\n", "1000"),
    (
        "rule exempt uid",
        "rules:\n  - name: r\n    action: log\n    exemptions: {users: [@]}\n"
        "    conditions: [{type: exe, operator: ==, value: x}]\n",
        "0",
    ),
]

NAME_FIELDS = {"user uid", "user uid list", "group gid", "exempt uid", "exempt gid", "rule exempt uid"}
SHORT_TEXTS = {"60 nines with a unit", "1e400 percent", "nan percent"}

# Numbers (and near-numbers) no field takes, as YAML text.
HUGE = [
    ("5000 digits", "9" * 5000),  # Python's int() refuses more than 4300 digits: ValueError in PyYAML
    ("-5000 digits", "-" + "9" * 5000),
    ("400 digits", "9" * 400),
    ("10**30", "1" + "0" * 30),
    ("2**64", str(2**64)),
    ("hex of 1000 digits", "0x" + "f" * 1000),
    ("binary of 100000 bits", "0b" + "1" * 100_000),  # no digit limit in base 2, str() of it fails
    ("sexagesimal", "1" + ":59" * 3000),  # PyYAML computes it in quadratic time
    ("1e400", "1.0e+400"),
    ("-1e400", "-1.0e+400"),
    (".inf", ".inf"),
    ("-.inf", "-.inf"),
    (".nan", ".nan"),
    ("!!int of 5000 digits", "!!int '" + "9" * 5000 + "'"),
    ("!!float word", "!!float abc"),
    ("400 nines as a string", "'" + "9" * 400 + "'"),
    ("400 nines with a unit", "'" + "9" * 400 + "GiB'"),
    ("60 nines with a unit", "'" + "9" * 60 + "s'"),
    ("1e400 percent", "'1e400%'"),
    ("nan percent", "'nan%'"),
    ("true", "true"),
    ("a bad date", "2001-13-40"),
]


@pytest.mark.parametrize("field, template, good", NUMERIC_FIELDS, ids=[f[0] for f in NUMERIC_FIELDS])
def test_every_numeric_field_takes_a_sane_value(field, template, good):
    text, _ = place(template, good)
    load_texts([("x.yaml", text)])


@pytest.mark.parametrize("what, value", HUGE, ids=[h[0] for h in HUGE])
@pytest.mark.parametrize("field, template, good", NUMERIC_FIELDS, ids=[f[0] for f in NUMERIC_FIELDS])
def test_numbers_of_any_size_are_errors_at_their_place(field, template, good, what, value):
    if field in NAME_FIELDS and what in SHORT_TEXTS:
        return  # a user or group name may be "1e400%"
    text, where = place(template, value)
    e = reject(text)
    assert e.errors[0].startswith(f"x.yaml:{where}: "), (field, what, e.errors)
    assert len(e.errors) == 1, e.errors


def _first_condition(p):
    return p.rules[0].conditions[0]


@pytest.mark.parametrize(
    "template, zero, get, expected",
    [
        ("cooldown: @\nrules: []\n", "-0", lambda p: p.settings.cooldown, 0.0),
        ("cooldown: @\nrules: []\n", "-0.0", lambda p: p.settings.cooldown, 0.0),
        (
            cond("gpu_utilization", extra="        value: @\n"),
            "-0.0",
            lambda p: _first_condition(p).text,
            "gpu_utilization > 0%",
        ),
        (
            cond("temperature", scope="per_device", extra="        value: @\n"),
            "-0.0",
            lambda p: _first_condition(p).text,
            "temperature > 0",
        ),
        (cond("user", "==", extra="        value: @\n"), "-0", lambda p: _first_condition(p).value, 0),
    ],
)
def test_minus_zero_is_zero(template, zero, get, expected):
    value = get(load_texts([("x.yaml", place(template, zero)[0])]))
    assert value == expected and str(value) == str(expected)  # 0.0, not -0.0


@pytest.mark.parametrize(
    "template", [cond("gpu_memory", extra="        value: @\n"), cond("user", "==", extra="        value: @\n")]
)
def test_a_float_is_neither_a_size_nor_a_uid(template):
    text, where = place(template, "-0.0")
    assert reject(text).errors[0].startswith(f"x.yaml:{where}: ")


def test_sizes_and_durations_have_a_maximum():
    gpu = cond("gpu_memory", extra="        value: @\n")
    assert load_texts([("x.yaml", place(gpu, f"{2**60}B")[0])]).rules[0].conditions[0].value == 2**60
    assert load_texts([("x.yaml", place(gpu, "1EiB")[0])]).rules[0].conditions[0].value == 2**60
    for too_large in (f"{2**60 + 1}B", "2EiB", "1025PiB", "1.5EiB", f"{2**63}B"):
        text, where = place(gpu, too_large)
        assert "larger than the maximum, 1 EiB" in reject(text).errors[0], too_large
    runtime = cond("runtime", extra="        value: @\n")
    assert load_texts([("x.yaml", place(runtime, "3650d")[0])]).rules[0].conditions[0].value == 3650 * 86400
    assert "longer than 100 years" in reject(place(runtime, "40000d")[0]).errors[0]


def test_parse_size_and_parse_duration_never_raise_anything_but_value_error():
    for value in (
        10**5000,
        -(10**5000),
        float("inf"),
        float("-inf"),
        float("nan"),
        1e400,
        "9" * 400,
        "9" * 400 + "GiB",
        "9" * 60 + "P",
        "1e400",
        "inf",
        "nan",
        "1" + " " * MiB + "x",
        None,
        [],
        {},
        b"8GiB",
        -0.0,
        True,
    ):
        with pytest.raises(ValueError):
            parse_size(value)
    for value in (
        10**5000,
        -(10**5000),
        float("inf"),
        float("-inf"),
        float("nan"),
        "9" * 400 + "s",
        "9" * 60 + "s",
        "1e400s",
        "1" * MiB,
        "1s" * MiB,
        None,
        [],
        b"5m",
        True,
    ):
        with pytest.raises(ValueError):
            parse_duration(value)
    assert parse_size(-0, bare=1) == 0 and parse_duration(-0.0) == 0.0 and str(parse_duration(-0.0)) == "0.0"


# -- YAML that makes PyYAML itself fail ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "what, text, where",
    [
        ("100,000 [", "rules: " + "[" * 100_000, "1:71"),  # the 65th level: the root mapping is the first
        ("100,000 [ closed", "rules: " + "[" * 100_000 + "]" * 100_000, "1:71"),
        ("100,000 {", "rules: " + "{a: " * 100_000, "1:"),
        ("block sequences 50,000 deep", "- " * 50_000 + "x\n", "1:"),
        ("block mappings 200 deep", "".join(" " * i + "a:\n" for i in range(200)), ""),
        ("a control character", "rules: []\n# \x01\n", "2:3"),
        ("a lone surrogate", "rules: []\n#\ud800\n", "2:2"),
        ("an escape beyond Unicode", 'rules: ["\\U00110000"]\n', "1:"),
        (
            "an escaped surrogate",
            'rules:\n  - name: r\n    action: log\n    description: "\\ud800"\n'
            "    conditions: [{type: exe, operator: ==, value: x}]\n",
            "4:18",
        ),
        ("an unknown tag", "dry_run: !!python/name:os.system ''\nrules: []\n", "1:10"),
        ("a tagged scalar on a mapping", "rules: !!int {}\n", "1:8"),
    ],
)
def test_yaml_that_breaks_pyyaml_is_an_error_with_a_place(what, text, where):
    e = reject(text)
    assert e.errors[0].startswith(f"x.yaml:{where}"), (what, e.errors)


def test_nesting_under_the_limit_is_read_and_then_refused_for_what_it_is():
    e = reject("rules: " + "[" * 60 + "]" * 60 + "\n")
    assert e.errors == ["x.yaml:1:9: a rule must be a mapping, not a list"]


# -- aliases, floods of errors, huge strings ------------------------------------------------------------------


def _alias_bomb(rules: int, items: int = 10_000) -> str:
    big = ", ".join(f"n{i}" for i in range(items))
    head = (
        "rules:\n  - name: r0\n    action: log\n    conditions:\n"
        f"      - {{type: process_name, operator: in, value: &big [{big}]}}\n"
    )
    return head + "".join(
        f"  - name: r{i}\n    action: log\n    conditions:\n      - {{type: process_name, operator: in, value: *big}}\n"
        for i in range(1, rules)
    )


def test_an_alias_bomb_is_refused_quickly_with_one_error():
    """10,000 items aliased into 1,000 rules: 10M items to validate without the bound on items visited."""
    e = reject(_alias_bomb(1000))
    assert len(e.errors) == 1 and "the policy is too large" in e.errors[0]
    assert f"more than {MAX_ITEMS}" in e.errors[0] and "alias" in e.errors[0]


def test_aliases_under_the_bound_load_and_their_text_is_short():
    policy = load_texts([("x.yaml", _alias_bomb(5))])
    for rule in policy.rules:
        (c,) = rule.conditions
        assert len(c.value) == 10_000 and len(c.text) <= MAX_TEXT
        assert c.text.startswith("process_name in [n0, n1, ") and c.text.endswith(" more]"), c.text


def test_billion_laughs_is_cheap():
    laughs = "".join(f"- &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n" for i in range(1, 12))
    text = "rules:\n- &l0 x\n" + laughs
    e = reject(text)
    assert e.errors[0].startswith("x.yaml:2:3: a rule must be a mapping")


def test_errors_are_capped():
    bad = ", ".join(str(i) for i in range(10_000))  # numbers where names go: 10,000 errors
    e = reject(cond("process_name", "in", extra=f"        value: [{bad}]\n"))
    assert len(e.errors) == MAX_ERRORS + 1 and e.errors[-1] == TOO_MANY_ERRORS
    assert str(e).endswith("(and many more; see gpukillctl guard validate)")


def test_aliased_bad_items_are_capped_too():
    bad = ", ".join(str(i) for i in range(1000))
    text = (
        "exemptions: {users: [a]}\nrules:\n  - name: r0\n    action: log\n    conditions:\n"
        f"      - {{type: process_name, operator: in, value: &bad [{bad}]}}\n"
        + "".join(
            f"  - name: r{i}\n    action: log\n    conditions:\n      - {{type: exe, operator: in, value: *bad}}\n"
            for i in range(1, 1000)
        )
    )
    e = reject(text)
    assert len(e.errors) == MAX_ERRORS + 1 and e.errors[-1] == TOO_MANY_ERRORS


def test_an_unreadable_aliased_value_is_reported_once():
    text = (
        "rules:\n  - name: r0\n    action: log\n    conditions:\n"
        f"      - {{type: gpu_memory, operator: '>', value: &huge {'9' * 5000}}}\n"
        + "".join(
            f"  - name: r{i}\n    action: log\n    conditions:\n"
            "      - {type: gpu_memory, operator: '>', value: *huge}\n"
            for i in range(1, 50)
        )
    )
    assert reject(text).errors == [
        "x.yaml:5:50: a number written with more than 100 characters is too large for any setting"
    ]


def test_errors_of_several_files_are_capped_together():
    bad = cond("process_name", "in", extra="        value: [" + ", ".join(map(str, range(500))) + "]\n")
    with pytest.raises(PolicyError) as info:
        load_texts([(f"{i}.yaml", bad) for i in range(5)])
    assert len(info.value.errors) == MAX_ERRORS + 1 and info.value.errors[-1] == TOO_MANY_ERRORS


def test_a_flood_of_unknown_keys_is_capped():
    e = reject("rules: []\n" + "".join(f"k{i}: 1\n" for i in range(20_000)))
    assert len(e.errors) == MAX_ERRORS + 1


@pytest.mark.parametrize(
    "template",
    [
        "@: 1\nrules: []\n",
        "rules:\n  - name: @\n    action: log\n    conditions: [{type: exe, operator: ==, value: x}]\n",
        "rules:\n  - name: r\n    action: @\n    conditions: [{type: exe, operator: ==, value: x}]\n",
        "rules:\n  - name: r\n    action: log\n    description: @\n"
        "    conditions: [{type: exe, operator: ==, value: x}]\n",
        "rules:\n  - name: r\n    action: log\n    conditions: [{type: @, operator: ==, value: x}]\n",
        "rules:\n  - name: r\n    action: log\n    conditions: [{type: exe, operator: @, value: x}]\n",
        "rules:\n  - name: r\n    action: log\n    conditions: [{type: exe, operator: ==, value: @}]\n",
        "rules:\n  - name: r\n    action: log\n    conditions: [{type: exe, operator: matches, value: @}]\n",
        "rules:\n  - name: r\n    action: log\n    conditions: [{type: user, operator: ==, value: @}]\n",
        "notify: [@]\nrules: []\n",
        "notify: ['webhook:http://@']\nrules: []\n",
        "notify: ['a@@']\nrules: []\n",
        "cooldown: @\nrules: []\n",
        "exemptions: {units: [@]}\nrules: []\n",
    ],
    ids=[
        "key",
        "rule name",
        "action",
        "description",
        "type",
        "operator",
        "value",
        "pattern",
        "user",
        "notify",
        "webhook",
        "e-mail",
        "duration",
        "unit pattern",
    ],
)
def test_a_megabyte_string_anywhere_is_refused_quickly_and_shortly(template):
    text, where = place(template, "a" * (MiB - 200))
    e = reject(text)
    assert sum(map(len, e.errors)) < 2000


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("'" + "x" * 4096 + "'", None),  # the longest string compared with a command line: accepted
        ("'" + "x" * 4097 + "'", "at most 4096 characters"),
    ],
)
def test_string_values_are_bounded(value, fragment):
    text, where = place(cond("cmdline", "==", extra="        value: @\n"), value)
    if fragment is None:
        c = load_texts([("x.yaml", text)]).rules[0].conditions[0]
        assert len(c.value) == 4096 and len(c.text) <= MAX_TEXT
    else:
        assert fragment in reject(text).errors[0]


def test_control_characters_in_messages_are_escaped():
    e = reject(
        'rules:\n  - name: r\n    action: "kill\\nnow\\x1b[2J"\n    conditions: [{type: exe, operator: ==, value: x}]\n'
    )
    assert e.errors == [
        "x.yaml:3:13: unknown action 'kill\\nnow\\x1b[2J' (known: kill, suspend, notify, log, reset, requeue, cancel)"
    ]


# -- the module's own regular expressions, on a megabyte ------------------------------------------------------


ADVERSARIAL = {
    "digits": "1" * MiB,
    "digits then x": "1" * MiB + "x",
    "spaces inside": "1" + " " * MiB + "x",
    "dotted domain": "a@" + "a." * (MiB // 2) + "!",
    "no dot": "a" * (MiB // 2) + "@" + "a" * (MiB // 2),
    "host": "http://" + "a" * MiB + " ",
    "path": "http://h/" + "a" * MiB + " ",
    "units": "1s" * (MiB // 2) + "x",
}


@pytest.mark.parametrize("what", ADVERSARIAL)
def test_policy_regexes_are_linear_on_a_megabyte(what):
    """Each is linear even unbounded (no nested or adjacent ambiguous repeats); the lengths are bounded anyway."""
    from gpukill import units

    s = ADVERSARIAL[what]
    for regex in (grammar._NAME.match, readers._EMAIL.match, readers._WEBHOOK.match, units._SIZE.fullmatch):
        with cpu_time() as took:
            regex(s)
        assert took.seconds < 0.5, (what, regex, took.seconds)
    with cpu_time() as took:
        for f in (parse_size, parse_duration):
            with pytest.raises(ValueError):
                f(s)
        assert notify_target_problem(s) and notify_target_problem("webhook:" + s)
    assert took.seconds < 0.1, took.seconds


def test_long_notify_targets_are_refused():
    assert notify_target_problem("a" * 242 + "@example.com") is None  # 254 characters
    assert "longer than 254" in notify_target_problem("a" * 243 + "@example.com")
    assert notify_target_problem("webhook:http://h/" + "a" * 2000) is None
    assert "longer than 2048" in notify_target_problem("webhook:http://h/" + "a" * 2048)


# -- regular expressions are RE2 --------------------------------------------------------------------------


MATCHES = cond("cmdline", "matches", extra="        value: @\n")


@pytest.mark.parametrize(
    "pattern, fragment",
    [
        (r"'(a)\1'", "backreferences"),
        (r"'(?P<n>a)(?P=n)'", "backreferences"),
        (r"'foo(?=bar)'", "lookahead and lookbehind"),
        (r"'foo(?!bar)'", "lookahead and lookbehind"),
        (r"'(?<=a)b'", "lookahead and lookbehind"),
        (r"'(?<!a)b'", "lookahead and lookbehind"),
        (r"'([a-z'", "missing ]"),
        ("'" + "a" * 1025 + "'", "longer than 1024 characters"),
    ],
)
def test_re2_refusals_are_errors_at_the_pattern(pattern, fragment):
    text, where = place(MATCHES, pattern)
    e = reject(text)
    assert e.errors[0].startswith(f"x.yaml:{where}: "), e.errors
    assert fragment in e.errors[0] and len(e.errors) == 1
    if "longer" not in fragment:
        assert e.errors[0].startswith(f"x.yaml:{where}: bad regular expression ")
        assert "RE2" in e.errors[0]


@pytest.mark.parametrize(
    "pattern, matching",
    [
        ("(.*)*X", "xxX"),
        ("(x+)+y", "xxy"),
        ("(x|xx)+z", "xxz"),
        ("(x*)*(x*)*(x*)*z", "xz"),
        ("^(([a-z])+.)+[A-Z]([a-z])+$", "xx.Xx"),
        ("(x+x+)+y", "xxxy"),
    ],
)
def test_a_backtracking_bomb_runs_in_linear_time(pattern, matching):
    """What would run for hours with Python's re: RE2 answers in microseconds, on a 4 KiB command line."""
    text, _ = place(MATCHES, repr(pattern))
    c = load_texts([("x.yaml", text)]).rules[0].conditions[0]
    test = string_test("matches", c.value)
    cmdline = "x" * 4096
    with cpu_time() as took:
        for _ in range(10):
            assert test(cmdline) is False
    assert took.seconds < 0.5, took.seconds
    assert test(matching) is True


def test_a_backtracking_bomb_in_an_engine_evaluation():
    from helpers.guard_inputs import OWN_PID, FakeTime, proc, snap

    from gpukilld.guard.engine import Engine

    text = (
        "rules:\n  - name: bomb\n    action: log\n"
        "    conditions: [{type: cmdline, operator: matches, value: '(x+x+)+y'}]\n"
    )
    t = FakeTime()
    engine = Engine(load_texts([("x.yaml", text)]), t.clock(), own_pid=OWN_PID)
    s = snap(*(proc(100 + i, cmdline="x" * 4096, start=100 + i) for i in range(50)))
    with cpu_time() as took:
        assert engine.evaluate(s, False) == []
    assert took.seconds < 1.0, took.seconds


def test_patterns_compare_by_their_text():
    """An unchanged rule keeps its windows on reload: fingerprints of RE2 patterns are their text."""
    text, _ = place(MATCHES, "'^python.*train'")
    a, b = (load_texts([("x.yaml", text)]).rules[0] for _ in range(2))
    assert a.fingerprint == b.fingerprint and hash(a.fingerprint) == hash(b.fingerprint)
    other = load_texts([("x.yaml", place(MATCHES, "'^python.*test'")[0])]).rules[0]
    assert other.fingerprint != a.fingerprint
    assert a.conditions[0].text == "cmdline matches /^python.*train/"


def test_a_pattern_used_a_thousand_times_is_compiled_once(monkeypatch):
    calls = []
    real = values.compile_regex
    monkeypatch.setattr(values, "compile_regex", lambda p: calls.append(p) or real(p))
    text = "rules:\n" + "".join(
        f"  - name: r{i}\n    action: log\n    conditions: [{{type: cmdline, operator: "
        f"matches, value: {'&p a+b' if i == 0 else '*p'}}}]\n"
        for i in range(1000)
    )
    assert len(load_texts([("x.yaml", text)]).rules) == 1000
    assert calls == ["a+b"]


# -- the parser raises nothing else -------------------------------------------------------------------------


def test_a_bug_in_the_parser_is_still_a_policy_error(monkeypatch):
    def boom(self, root):
        raise KeyError("a bug")

    monkeypatch.setattr(grammar._Parser, "document", boom)
    with pytest.raises(PolicyError) as info:
        load_texts([("x.yaml", "rules: []\n")])
    assert info.value.errors == ["x.yaml:1:1: the policy could not be read (KeyError: 'a bug')"]


def test_a_fifo_in_guard_d_does_not_block(tmp_path: Path):
    import os

    (tmp_path / "10-ok.yaml").write_text("rules: []\n")
    os.mkfifo(tmp_path / "20-fifo.yaml")
    (tmp_path / "30-dir.yaml").mkdir()
    with pytest.raises(PolicyError) as info:
        P.load_directory(str(tmp_path))
    assert info.value.errors == [
        f"{tmp_path}/20-fifo.yaml:1:1: cannot read: not a regular file",
        f"{tmp_path}/30-dir.yaml:1:1: cannot read: Is a directory",
    ]
    # gpukillctl guard load /dev/stdin: a pipe is read where the caller asks for it
    r, w = os.pipe()
    try:
        os.write(w, b"rules: []\n")
        os.close(w)
        assert P.read_text(f"/proc/self/fd/{r}") == "rules: []\n"
    finally:
        os.close(r)


# -- the runner: a broken guard.d never stops the daemon ------------------------------------------------------


GOOD = (
    "rules:\n  - name: good\n    action: log\n    conditions:\n"
    "      - {type: process_name, operator: ==, value: xmrig}\n"
)


class Journal:
    def __init__(self) -> None:
        self.entries: list[tuple[str, dict]] = []

    def log(self, kind, message: str, **fields) -> None:
        self.entries.append((message, fields))

    def rejected(self) -> list[dict]:
        return [f for _, f in self.entries if f.get("result") == "rejected"]


def _runner(tmp_path: Path, journal: Journal):
    from gpukilld.guard.notify import NotifyConfig
    from gpukilld.guard.runner import GuardRunner

    async def kill(*args, **kwargs):
        raise AssertionError("no kill in these tests")

    return GuardRunner(
        kill, journal, NotifyConfig(), str(tmp_path / "guard.d"), str(tmp_path / "state"), own_pid=4_000_000
    )


def _good_start(tmp_path: Path) -> tuple[Path, Journal]:
    """guard.d with a good policy, and a journal to see what a runner started on it reports."""
    guard_d = tmp_path / "guard.d"
    guard_d.mkdir()
    (guard_d / "10-policy.yaml").write_text(GOOD)
    return guard_d, Journal()


MORE = GOOD + "      - {type: gpu_memory, operator: '>', value: @}\n"


@pytest.mark.parametrize(
    "broken, where",
    [
        place(MORE, "9" * 5000),  # PyYAML's int() raises ValueError: uncaught, the daemon crash-loops
        place(MORE, "'" + "9" * 400 + "GiB'"),  # parse_size did int(float(...)) = int(inf): OverflowError
        place(MORE, "1.0e+400"),
        ("rules: " + "[" * 100_000, "1:71"),  # RecursionError in PyYAML's composer
        ('rules: ["\\U00110000"]\n', "1:"),  # ValueError from chr() in PyYAML's scanner
    ],
)
def test_a_runner_with_a_broken_guard_d_starts_and_keeps_the_last_good_policy(tmp_path, broken, where):
    guard_d, journal = _good_start(tmp_path)
    runner = _runner(tmp_path, journal)
    runner.start()
    assert [r.name for r in runner.policy.rules] == ["good"] and runner.policy_error == ""
    runner.stop()

    (guard_d / "10-policy.yaml").write_text(broken)  # broken while the daemon was down
    journal = Journal()
    runner = _runner(tmp_path, journal)
    runner.start()  # no exception: the daemon starts
    try:
        assert [r.name for r in runner.policy.rules] == ["good"]  # the last good policy, from the state
        assert runner.policy_error.startswith(f"{guard_d}/10-policy.yaml:{where}"), runner.policy_error
        assert "\n" not in runner.policy_error
        (rejection,) = journal.rejected()
        assert rejection["requested_by"] == "start" and rejection["error"] == runner.policy_error
        # a reload with the file still broken keeps it too; LoadPolicy of the same text is refused
        assert runner.reload_files() is False and [r.name for r in runner.policy.rules] == ["good"]
        with pytest.raises(PolicyError):
            runner.load_policy("new.yaml", broken, "uid 0")
        assert [r.name for r in runner.policy.rules] == ["good"] and len(journal.rejected()) == 3
    finally:
        runner.stop()


def test_a_runner_without_a_last_good_policy_starts_with_none(tmp_path):
    guard_d = tmp_path / "guard.d"
    guard_d.mkdir()
    (guard_d / "10-policy.yaml").write_text("max_kills_per_cycle: " + "9" * 5000 + "\nrules: []\n")
    runner = _runner(tmp_path, Journal())
    runner.start()
    try:
        assert runner.policy.rules == () and runner.policy_error.startswith(f"{guard_d}/10-policy.yaml:1:22: ")
    finally:
        runner.stop()


def test_a_runner_survives_an_unexpected_failure_of_the_parser(tmp_path, monkeypatch):
    """The last resort: anything but PolicyError (a bug) is a rejection too, with the place it came from."""
    from gpukilld.guard import runner as runner_module

    guard_d, journal = _good_start(tmp_path)
    runner = _runner(tmp_path, journal)
    runner.start()
    runner.stop()

    def broken(texts):
        raise RuntimeError("a bug\nwith two lines")

    monkeypatch.setattr(runner_module, "load_texts", broken)
    runner = _runner(tmp_path, journal)
    runner.start()
    try:
        assert runner.policy.rules == ()  # the saved policy goes through the same broken function
        assert runner.policy_error == (
            f"{guard_d}:1:1: the policy could not be read (RuntimeError: a bug with two lines)"
        )
        assert runner.reload_files() is False
        with pytest.raises(PolicyError) as info:
            runner.load_policy("new.yaml", GOOD, "uid 0")
        assert info.value.errors == ["new.yaml:1:1: the policy could not be read (RuntimeError: a bug with two lines)"]
    finally:
        runner.stop()
