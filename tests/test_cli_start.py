"""What a one-shot gpukillctl command pays before it connects (bench/cli_start): the parser of the command asked
for alone, argparse's help width without shutil, and the same parse and help as the whole parser gives."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpukillctl.cli import main as cli

REPO = Path(__file__).resolve().parent.parent

LINES = (["list", "--json"], ["list", "--device", "1", "--min-memory", "5"], ["-H", "box", "list", "--user", "x"],
         ["kill", "12", "--force", "--grace", "2"], ["kill", "--job", "77"], ["reset", "0", "--force"], ["status"],
         ["guard", "status"], ["guard", "test", "--policy", "p.yaml"], ["audit", "--json"])


@pytest.mark.parametrize("argv", LINES, ids=" ".join)
def test_the_one_commands_parser_parses_as_the_whole_one(argv):
    word = cli.command_word(argv)
    assert word in cli.ONE_SHOT
    assert cli.build_parser(full=False, only=word).parse_args(argv) == cli.build_parser().parse_args(argv)


def test_only_builds_that_command_alone():
    sub = next(a for a in cli.build_parser(full=False, only="list")._actions
               if isinstance(a, cli.argparse._SubParsersAction))
    assert list(sub.choices) == ["list"]


@pytest.mark.parametrize("columns", ["40", "133", "0", "-5", "wide", None])
def test_help_width_is_argparses(monkeypatch, columns):
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    cli.help_width.cache_clear()
    try:
        assert cli.help_width() == shutil.get_terminal_size().columns - 2
    finally:
        cli.help_width.cache_clear()


def test_the_list_path_imports_no_shutil():
    # shutil comes with bz2, lzma and zlib: ~1.5 ms of a ~45 ms `gpukillctl list --json`
    probe = ("import sys; import gpukillctl.cli.main as c; "
             "c.build_parser(full=False, only='list').parse_args(['list', '--json']); print('shutil' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout


@pytest.mark.parametrize("argv", [["list", "--help"], ["kill", "--help"], ["guard", "--help"], ["--help"]])
def test_help_is_the_same_as_argparses_own(argv):
    # what --help writes is what argparse writes with its own formatters (which ask shutil for the width)
    env = {"COLUMNS": "70", "PATH": "/usr/bin:/bin"}
    ours = subprocess.run([sys.executable, "-m", "gpukillctl", *argv], cwd=REPO, capture_output=True, text=True,
                          env=env)
    plain = ("import argparse, sys; from gpukillctl.cli import main as cli; "
             "argparse.ArgumentParser._get_formatter = lambda self: self.formatter_class(prog=self.prog); "
             f"cli.Parser._get_formatter = argparse.ArgumentParser._get_formatter; cli.main({argv!r})")
    theirs = subprocess.run([sys.executable, "-c", plain], cwd=REPO, capture_output=True, text=True, env=env)
    assert ours.returncode == theirs.returncode == 0
    assert ours.stdout == theirs.stdout and "usage:" in ours.stdout
