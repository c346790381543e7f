"""The checkpoint declaration's grammar (GPUKILL_CHECKPOINT, gpukill/checkpoint.py), the policy's keys for it
(a kill rule's `checkpoint:`, the settings' `max_checkpoint_wait`) and how a violation words the signals sent
at its grace's start: pure, no daemon."""

from __future__ import annotations

import signal

import pytest

from gpukill.checkpoint import (
    DEFAULT_MAX_WAIT,
    FROM_ENVIRONMENT,
    MAX_DECLARATION,
    BadDeclaration,
    Declaration,
    from_environ,
    parse_declaration,
)
from gpukill.policy import PolicyError, load_texts
from gpukilld.acts.checkpoint import Asked, asked_text
from gpukilld.guard import report
from gpukilld.guard.engine import Target, Violation


@pytest.mark.parametrize(
    "text, number, wait, each",
    [
        ("USR1:120s", signal.SIGUSR1, 120.0, False),
        ("SIGUSR2:2m", signal.SIGUSR2, 120.0, False),
        ("usr1:1h30m:each", signal.SIGUSR1, 5400.0, True),
        (" TERM:90 ", signal.SIGTERM, 90.0, False),
        ("INT:500ms:EACH", signal.SIGINT, 0.5, True),
    ],
)
def test_declarations_read(text, number, wait, each):
    d = parse_declaration(text)
    assert (d.signal, d.wait, d.each, d.source) == (number, wait, each, FROM_ENVIRONMENT)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("USR1", "is not SIG:DURATION"),
        ("USR1:2m:all", "is not SIG:DURATION"),
        ("KILL:2m", "SIGKILL cannot be a checkpoint signal"),
        ("SIGSTOP:2m", "SIGSTOP cannot be a checkpoint signal"),
        ("RTMIN:2m", "cannot be a checkpoint signal"),
        ("NOPE:2m", "unknown signal 'NOPE'"),
        (":2m", "a checkpoint signal is a name"),
        ("USR1:0s", "more than 0s"),
        ("USR1:soon", "not a duration"),
        ("USR1:-5", "not a duration"),
        ("USR1:" + "9" * MAX_DECLARATION, "longer than"),
    ],
)
def test_malformed_declarations_say_why_in_one_line(text, fragment):
    with pytest.raises(BadDeclaration) as info:
        parse_declaration(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_the_environment_declares_or_not():
    assert from_environ(b"A=1\0B=2\0") is None
    assert from_environ(b"A=1\0GPUKILL_CHECKPOINT=USR1:2m\0") == Declaration(signal.SIGUSR1, 120.0)
    assert isinstance(from_environ(b"GPUKILL_CHECKPOINT=KILL:2m\0"), BadDeclaration)
    assert from_environ(b"XGPUKILL_CHECKPOINT=USR1:2m\0") is None


def test_a_declaration_says_itself():
    d = parse_declaration("USR1:120s:each")
    assert d.name == "SIGUSR1" and d.text == "USR1:2min:each" and d.capped(30) == 30 and d.capped(600) == 120


RULE = """\
max_checkpoint_wait: {cap}
rules:
  - name: r
    action: {action}
    grace_period: 1m
    conditions:
      - {{type: gpu_memory, operator: '>', value: 1GiB}}
    checkpoint: {checkpoint}
"""


def test_a_kill_rule_declares_for_its_victims():
    policy = load_texts([("p.yaml", RULE.format(cap="2m", action="kill", checkpoint="{signal: USR1, wait: 5m}"))])
    rule = policy.rules[0]
    assert rule.checkpoint == Declaration(signal.SIGUSR1, 300.0, False, "policy p.yaml:8:17")
    assert policy.settings.max_checkpoint_wait == 120.0
    each = load_texts(
        [("p.yaml", RULE.format(cap="0", action="kill", checkpoint="{signal: HUP, wait: 1s, each: true}"))]
    )
    assert each.rules[0].checkpoint.each and each.settings.max_checkpoint_wait == 0.0
    assert rule.fingerprint != each.rules[0].fingerprint


def test_the_cap_defaults_to_ten_minutes():
    text = "rules:\n  - name: r\n    action: kill\n    conditions:\n"
    text += "      - {type: gpu_memory, operator: '>', value: 1GiB}\n"
    policy = load_texts([("p.yaml", text)])
    assert policy.settings.max_checkpoint_wait == DEFAULT_MAX_WAIT == 600.0 and policy.rules[0].checkpoint is None


@pytest.mark.parametrize(
    "action, checkpoint, cap, where, fragment",
    [
        ("notify", "{signal: USR1, wait: 2m}", "2m", "8:5", "checkpoint applies only to action kill, not notify"),
        ("kill", "{signal: KILL, wait: 2m}", "2m", "8:26", "SIGKILL cannot be a checkpoint signal"),
        ("kill", "{signal: USR1}", "2m", "8:17", "checkpoint needs a 'wait'"),
        ("kill", "{signal: USR1, wait: 2m, every: true}", "2m", "8:42", "unknown field 'every' in checkpoint"),
        ("kill", "{signal: USR1, wait: never}", "2m", "8:38", "the checkpoint wait: not a duration"),
        ("kill", "USR1:2m", "2m", "8:17", "checkpoint must be a mapping"),
        ("kill", "{signal: USR1, wait: 2m}", "soon", "1:22", "max_checkpoint_wait"),
    ],
)
def test_a_bad_checkpoint_key_is_reported_where_it_is(action, checkpoint, cap, where, fragment):
    with pytest.raises(PolicyError) as info:
        load_texts([("p.yaml", RULE.format(cap=cap, action=action, checkpoint=checkpoint))])
    errors = info.value.errors
    assert any(e.startswith(f"p.yaml:{where}: ") and fragment in e and "\n" not in e for e in errors), errors


def test_the_violation_and_the_owners_warning_say_the_job_was_asked_to_save():
    rule = load_texts([("p.yaml", RULE.format(cap="2m", action="kill", checkpoint="{signal: USR1, wait: 5m}"))]).rules[
        0
    ]
    target = Target(42, 7, 1000, "alice", "train", 1 << 30, 0.0)
    ev = Violation(rule, "PID 42 (train, user alice)", ("k",), 1000, (target,), "gpu_memory > 1 GiB", 0.0)
    asked = [Asked(42, 7, "train", rule.checkpoint, 120.0, 0.0)]
    sent = report.violation(ev, False, "host", 0.0, asked_text(asked, False))
    assert "sent SIGUSR1 to PID 42 to save, waiting up to 2min" in sent.entries[0].journal.message
    assert "Checkpoint: the job was asked to save its work now" in sent.notice.body
    dry = report.violation(ev, True, "host", 0.0, asked_text(asked, True))
    assert "would send SIGUSR1 to PID 42 and wait up to 2min" in dry.entries[0].journal.message
    assert "Checkpoint:" not in dry.notice.body
    assert asked_text([], False) == ""
