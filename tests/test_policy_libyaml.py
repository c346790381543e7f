"""Policies are read by libyaml's scanner and parser where PyYAML has them, and by PyYAML's own otherwise.

The libyaml reading is the fast one (a hostile flood of keys in a tenth of the time); whatever libyaml finds
fault with is read again by PyYAML's Python parser, so every error reads as it did before. What the two may
disagree on is only YAML that PyYAML's scanner wrongly refuses (a tab as separation, `2?h` in a flow mapping):
libyaml, which follows the YAML spec there, accepts it. These tests hold the readings to that.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
from helpers.cpu_time import cpu_time

from gpukill.policy import PolicyError, load_texts, yaml_safe

ROOT = Path(__file__).resolve().parent.parent
CORPUS = sorted(
    [
        *ROOT.glob("examples/guard.d/*.yaml"),
        ROOT / "examples/guard.yaml",
        ROOT / "examples/simulate.yaml",
        *ROOT.glob("tests/guard_policies/*.yaml"),
    ]
)
YAML_CHARACTERS = " \t\n:-[]{},'\"#&*!|>%@`?\\"
needs_libyaml = pytest.mark.skipif(yaml_safe._CParser is None, reason="this PyYAML is built without libyaml")


def outcome(text: str) -> tuple[str, object]:
    try:
        return "policy", repr(load_texts([("x.yaml", text)]))
    except PolicyError as e:
        return "errors", e.errors


def python_only(text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, object]:
    with monkeypatch.context() as m:
        m.setattr(yaml_safe, "_CParser", None)
        return outcome(text)


def mutants(text: str, count: int, seed: int) -> list[str]:
    """The text with one to three YAML characters inserted or deleted at random places."""
    rnd, out = random.Random(seed), []
    for _ in range(count):
        chars = list(text)
        for _ in range(rnd.randint(1, 3)):
            i = rnd.randrange(len(chars) + 1)
            if chars and rnd.random() < 0.4:
                del chars[min(i, len(chars) - 1)]
            else:
                chars.insert(i, rnd.choice(YAML_CHARACTERS))
        out.append("".join(chars))
    return out


@needs_libyaml
@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_a_valid_policy_is_read_by_libyaml_and_means_the_same(path: Path, monkeypatch: pytest.MonkeyPatch):
    text = path.read_text()
    assert yaml_safe._fast_nodes(text) is not None
    assert outcome(text) == python_only(text, monkeypatch)


@needs_libyaml
def test_a_flood_of_keys_is_read_in_a_fraction_of_the_python_time(monkeypatch: pytest.MonkeyPatch):
    text = "rules: []\n" + "".join(f"k{i}: 1\n" for i in range(20_000))

    def seconds(read) -> float:
        # this thread's CPU time, with the collector off: neither the machine's load, nor another thread of
        # this worker (process_time counted those: 0.40 s against 0.77 s where this VM reads 0.12 s against
        # 0.63 s), nor a collection whose cost is what the worker holds, is counted against either reading
        gc.collect()
        gc.disable()
        try:
            with cpu_time() as took:
                assert read(text)[0] == "errors"
        finally:
            gc.enable()
        return took.seconds

    # interleaved, best of three each: a reading slowed by whatever remains does not decide the comparison
    python, fast = float("inf"), float("inf")
    for _ in range(3):
        python = min(python, seconds(lambda t: python_only(t, monkeypatch)))
        fast = min(fast, seconds(outcome))
    assert fast < python / 2, (fast, python)


@needs_libyaml
@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_the_readings_differ_only_where_pyyaml_wrongly_refuses_yaml(path: Path, monkeypatch: pytest.MonkeyPatch):
    differ = 0
    for text in mutants(path.read_text(), 150, seed=len(path.name)):
        fast, python = outcome(text), python_only(text, monkeypatch)
        if fast != python:
            differ += 1
            # PyYAML refused the YAML itself; libyaml read it, and the policy it holds is judged as usual
            assert python[0] == "errors" and "not valid YAML" in python[1][0], (text, fast, python)
            assert fast[0] == "policy" or "not valid YAML" not in fast[1][0], (text, fast, python)
    assert differ <= 15  # a few per cent of the mutants: tabs and `?`s mostly


@needs_libyaml
@pytest.mark.parametrize(
    "text",
    [
        'rules:\n  - {name: "ünïcödé ☃ 𝄞", action: kil, conditions: [{type: exe, operator: ==, value: x}]}\n',
        'rules:\n  - name: "日本語"\n    description: "𝄞𝄞𝄞"\n    action: kil\n'
        "    conditions: [{type: bogus, operator: ==, value: 1}]\n",
        "\ufeffrules:\n  - {name: é, action: kil, conditions: []}\n",
        "rules:\r\n  - {name: é, action: kil, conditions: []}\r\n",
    ],
    ids=["astral and accented", "CJK lines", "byte-order mark", "CRLF"],
)
def test_lines_and_columns_agree_past_non_ascii_text(text: str, monkeypatch: pytest.MonkeyPatch):
    """libyaml counts columns in characters as PyYAML does: FILE:LINE:COL names the same place either way."""
    fast = outcome(text)
    assert fast[0] == "errors" and any("unknown action 'kil'" in line for line in fast[1]), fast
    assert fast == python_only(text, monkeypatch)
