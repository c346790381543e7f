"""Writes the bash and zsh completions of every console script in pyproject.toml into a directory.

Each script's module (the part before ":" of its entry point) has build_parser(), the parser the command
runs with, so a command or option added there is completed without touching this file or the Makefile.
`make deb`/`make rpm` run it (shtab is a build-time dependency: the test extra); tests/test_manpages.py runs
it too and checks that every command and option of every parser is in the output.

    python packaging/completions.py OUTDIR   ->  OUTDIR/NAME.bash, OUTDIR/_NAME for each script NAME
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tomllib
from pathlib import Path

import shtab

REPO = Path(__file__).resolve().parent.parent


def console_scripts() -> dict[str, str]:
    """Script name -> module that defines it, as pyproject.toml declares them."""
    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    return {name: target.split(":", 1)[0] for name, target in scripts.items()}


def build_parser(name: str) -> argparse.ArgumentParser:
    return importlib.import_module(console_scripts()[name]).build_parser()


def write_completions(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in console_scripts():
        for shell, file_name in (("bash", f"{name}.bash"), ("zsh", f"_{name}")):
            path = out / file_name
            path.write_text(shtab.complete(build_parser(name), shell=shell))
            written.append(path)
    return written


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: completions.py OUTDIR", file=sys.stderr)
        return 2
    for path in write_completions(Path(sys.argv[1])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
