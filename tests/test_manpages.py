"""The manual pages, the --help texts and the shell completions keep up with the code.

Every console script of pyproject.toml has a man page in man/ and generated completions; every command and
option of its parser (subcommands and nested ones included, read at test time, so a command added later is
checked too) is documented in the page and completed by both shells. gpukill-policy(5) lists exactly the
policy keys of gpukill/policy/ and the condition types of gpukill/condition_types.py with their kinds,
operators and scopes; gpukilld.conf(5) every section and key gpukilld/config.py accepts. The packages install
every page and every completion, and --help points to the pages, never to README.md (not installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.testbed import REPO

from gpukill import policy, rules
from gpukill.condition_types import CONDITION_TYPES, OPERATORS
from gpukilld import config

MAN = REPO / "man"


def _load_completions():
    """packaging/completions.py, what `make deb` and `make rpm` run (a script, not a package module)."""
    path = REPO / "packaging" / "completions.py"
    spec = importlib.util.spec_from_file_location("packaging_completions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


completions = _load_completions()

SCRIPTS = completions.console_scripts()


# -- reading man source --------------------------------------------------------------------------------------


def page_of(prog: str) -> Path:
    pages = sorted(MAN.glob(f"{prog}.[1-8]"))
    assert len(pages) == 1, f"{prog}: expected one man page man/{prog}.N, found {pages}"
    return pages[0]


def source(page: Path) -> str:
    """The page's source with escaped hyphens plain and font changes removed, so options read as typed."""
    return re.sub(r"\\f[BIRP]", "", page.read_text().replace("\\-", "-"))


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^\.SH +", text, flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip().strip('"'): part.split("\n", 1)[1] for part in parts}


def tokens(line: str) -> list[str]:
    """The words of a source line without its macro (".BR"), quotes and punctuation around words."""
    if line.startswith("."):
        line = line.split(" ", 1)[1] if " " in line else ""
    return [w.rstrip(".") for w in re.split(r"[\s,|\[\]{}()\";:]+", line) if w.rstrip(".")]


def entries(section: str) -> list[tuple[list[str], list[str]]]:
    """Each .TP item of a section: the words of its tag, and the words of its tag and paragraph together."""
    lines = section.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line == ".TP":
            tag = tokens(lines[i + 1])
            body = []
            for following in lines[i + 2 :]:
                if following in (".TP", ".PP") or following.startswith((".SH", ".SS")):
                    break
                body += tokens(following)
            found.append((tag, tag + body))
    return found


def tags(section: str) -> set[str]:
    return {tag[0] for tag, _ in entries(section)}


# -- reading parsers -----------------------------------------------------------------------------------------


Command = tuple[tuple[str, ...], argparse.ArgumentParser]  # a command's words after the program, its parser


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Command]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]


def options(parser: argparse.ArgumentParser, with_help: bool) -> list[str]:
    return [
        s
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and (with_help or not isinstance(a, argparse._HelpAction))
        for s in a.option_strings
    ]


def values(parser: argparse.ArgumentParser) -> list[str]:
    """The fixed words an argument takes (`dry-run on|off`, `--log-level debug`): documented with it."""
    return [
        str(c)
        for a in parser._actions
        if a.choices is not None and a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
        for c in a.choices
    ]


def all_commands() -> list[tuple[str, tuple[str, ...], argparse.ArgumentParser]]:
    return [(prog, path, p) for prog in SCRIPTS for path, p in commands(completions.build_parser(prog))]


def command_id(item: tuple) -> str:
    return " ".join((item[0], *item[1]))


# -- man pages of the commands -------------------------------------------------------------------------------


@pytest.mark.parametrize("prog", list(SCRIPTS))
def test_each_command_is_in_the_synopsis_and_has_an_entry(prog):
    parser = completions.build_parser(prog)
    man = sections(source(page_of(prog)))
    names = subcommands(parser)
    if not names:
        return
    synopsis = {line.split()[2] for line in man["SYNOPSIS"].splitlines() if line.startswith(f".B {prog} ")}
    assert synopsis == set(names), f"SYNOPSIS: missing {set(names) - synopsis}, gone {synopsis - set(names)}"
    documented = tags(man["COMMANDS"])
    assert documented == set(names), f"COMMANDS: missing {set(names) - documented}, gone {documented - set(names)}"


@pytest.mark.parametrize("item", all_commands(), ids=command_id)
def test_each_option_is_in_the_man_page(item):
    """A command's options and the words they take are in its entry under COMMANDS (an entry whose tag starts
    with the command's words); the options of the program itself each have a tag under OPTIONS."""
    prog, path, parser = item
    man = sections(source(page_of(prog)))
    if not path:
        documented = {word for tag, _ in entries(man.get("OPTIONS", "")) for word in tag}
        wanted = options(parser, with_help=True)
        if not subcommands(parser):
            wanted += values(parser)
            documented |= {word for _, text in entries(man.get("OPTIONS", "")) for word in text}
    else:
        matching = [text for tag, text in entries(man["COMMANDS"]) if tuple(tag[: len(path)]) == path]
        assert matching, f"no entry for `{prog} {' '.join(path)}` under COMMANDS"
        documented = {word for text in matching for word in text}
        wanted = options(parser, with_help=False) + values(parser)
    missing = [w for w in wanted if w not in documented]
    assert not missing, f"{page_of(prog).name}: `{' '.join((prog, *path))}` lacks {missing}"


def test_exit_codes_are_the_same_in_help_the_man_page_and_the_cli():
    from gpukillctl.client import exits

    man = sections((MAN / "gpukillctl.1").read_text())
    codes = {int(line.split()[0]) for line in exits.EXIT_CODES_HELP.splitlines() if line.strip()[:2].strip().isdigit()}
    items = " ".join(man["EXIT STATUS"].split()).split(";")
    assert all(item.split()[0].isdigit() for item in items), items
    assert {int(item.split()[0]) for item in items} == codes
    assert codes == {v for k, v in vars(exits).items() if k.startswith("EXIT_") and isinstance(v, int)}


def test_every_json_key_of_list_is_in_the_man_page():
    from gpukillctl.client.dbus import DEVICE_KEYS, PROCESS_KEYS

    json_section = sections(source(MAN / "gpukillctl.1"))["JSON OUTPUT"]
    documented = {tag[0]: set(text) for tag, text in entries(json_section)}
    assert not set(DEVICE_KEYS) - documented["DEVICE"]
    assert not set(PROCESS_KEYS) - documented["PROCESS"]


def pages_named(text: str) -> set[str]:
    """The man pages a help text points to, as `man NAME` or NAME(SECTION); as file names in man/."""
    named = {f"{name}.[1-8]" for name in re.findall(r"\bman ([a-z][\w.-]*[a-z0-9])", text)}
    return named | {f"{name}.{section}" for name, section in re.findall(r"\b([a-z][\w.-]*)\(([1-8])\)", text)}


@pytest.mark.parametrize("prog", list(SCRIPTS))
def test_help_points_to_man_pages_never_to_the_readme(prog):
    helps = {" ".join((prog, *path)): p.format_help() for path, p in commands(completions.build_parser(prog))}
    named = {page.name for pattern in pages_named(helps[prog]) for page in MAN.glob(pattern)}
    assert page_of(prog).name in named, f"`{prog} --help` does not point to its own man page"
    for where, text in helps.items():
        assert "README" not in text, f"`{where} --help` points to the README, which packages do not install"
        for pattern in pages_named(text):
            assert list(MAN.glob(pattern)), f"`{where} --help` points to {pattern}: no such page in man/"


def test_gpukillctl_help_points_to_the_policy_page():
    from gpukillctl.cli import main as cli

    guard = dict(commands(cli.build_parser()))[("guard",)]
    assert "man gpukill-policy" in guard.format_help()


# -- completions ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """What the packages ship, made the way `make deb` and `make rpm` make it."""
    out = tmp_path_factory.mktemp("completions")
    r = subprocess.run(
        [sys.executable, str(REPO / "packaging" / "completions.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("item", all_commands(), ids=command_id)
def test_each_command_and_option_is_completed(generated, item):
    prog, path, parser = item
    prefix = re.sub(r"\W", "_", "_".join(("_shtab", prog, *path)))
    bash = (generated / f"{prog}.bash").read_text()
    zsh = (generated / f"_{prog}").read_text()

    def bash_array(name: str) -> list[str]:
        found = re.search(rf"^{prefix}_{name}=\((.*)\)$", bash, flags=re.M)
        assert found, f"{prog}.bash: no {prefix}_{name}"
        return found.group(1).replace("'", "").split()

    def zsh_block(name: str) -> str:
        found = re.search(rf"^{prefix}_{name}\b.*?\n *\)\n", zsh, flags=re.M | re.S)
        assert found, f"_{prog}: no {prefix}_{name}"
        return found.group(0)

    missing = [o for o in options(parser, with_help=True) if o not in bash_array("option_strings")]
    assert not missing, f"{prog}.bash lacks {missing} for `{command_id(item)}`"
    zsh_options = zsh_block("options")
    missing = [o for o in options(parser, with_help=True) if not re.search(rf"(?<![\w-]){o}(?![\w-])", zsh_options)]
    assert not missing, f"_{prog} lacks {missing} for `{command_id(item)}`"
    if names := subcommands(parser):
        assert set(names) <= set(bash_array("subparsers")), f"{prog}.bash"
        zsh_commands = zsh_block("commands")
        assert all(re.search(rf"^ *{re.escape(n)}:", zsh_commands, flags=re.M) for n in names), f"_{prog}"


# -- the file formats ----------------------------------------------------------------------------------------


def test_policy_page_lists_every_key():
    man = sections(source(MAN / "gpukill-policy.5"))
    assert tags(man["SETTINGS"]) == set(policy.TOP_KEYS)
    assert tags(man["RULES"]) == set(policy.RULE_KEYS)
    assert tags(man["CONDITIONS"]) == set(policy.CONDITION_KEYS)
    assert tags(man["EXEMPTIONS"]) == set(policy.EXEMPTION_KEYS)
    rule_keys = {tag[0]: set(text) for tag, text in entries(man["RULES"])}
    for key, words in (("scope", rules.SCOPES), ("action", rules.ACTIONS), ("match", rules.MATCHES)):
        assert set(words) <= rule_keys[key], key
    assert {word for tag, _ in entries(man["OPERATORS"]) for word in tag} == set(OPERATORS)


def condition_table(section: str) -> dict[str, list[str]]:
    """The tbl table under CONDITION TYPES: type -> its cells, text blocks (T{ ... T}) joined into a cell."""
    table = section.split(".TS\n", 1)[1].split(".TE\n", 1)[0]
    body = table.split(" .\n", 1)[1]
    body = re.sub(r"T\{\n(.*?)\nT\}", lambda m: m.group(1).replace("\n", " "), body, flags=re.S)
    rows = [line.split("\t") for line in body.splitlines()[2:]]  # after the heading and its rule
    return {row[0]: row[1:] for row in rows}


def test_policy_page_lists_each_condition_type_with_its_kind_operators_and_scopes():
    section = sections(source(MAN / "gpukill-policy.5"))["CONDITION TYPES"]
    table = condition_table(section)
    assert set(table) == set(CONDITION_TYPES)
    assert tags(section) == set(CONDITION_TYPES), "each type has its own entry under the table"
    for name, (kind, operators, scopes) in table.items():
        t = CONDITION_TYPES[name]
        assert kind == t.kind, name
        assert operators.split() == list(t.operators), name
        taken, _, selecting = scopes.partition("selects in")
        assert set(re.findall(r"per_\w+", scopes)) == set(t.roles), name
        roles = {role: {s for s, r in t.roles.items() if r == role} for role in (rules.SUBJECT, rules.SELECTOR)}
        assert set(re.findall(r"per_\w+", taken)) == roles[rules.SUBJECT], name
        assert set(re.findall(r"per_\w+", selecting)) == roles[rules.SELECTOR], name


def test_config_page_lists_every_section_and_key():
    man = sections(source(MAN / "gpukilld.conf.5"))
    documented = {title[1:-1] for title in man if title.startswith("[")}
    assert documented == set(config._KNOWN)
    for section, keys in config._KNOWN.items():
        assert tags(man[f"[{section}]"]) == keys, section


# -- packages ------------------------------------------------------------------------------------------------


def test_the_packages_install_every_page_and_completion():
    debian = (REPO / "packaging" / "debian" / "rules").read_text()
    rpm = (REPO / "packaging" / "rpm" / "gpukill.spec").read_text()
    rpm_files = rpm.split("\n%files", 1)[1]
    for page in sorted(MAN.glob("*.[1-8]")):
        section = page.suffix[1:]
        assert f"man/{page.name} debian/gpukill/usr/share/man/man{section}/{page.name}\n" in debian, page.name
        assert f"man/{page.name} %{{buildroot}}%{{_mandir}}/man{section}/{page.name}\n" in rpm, page.name
        assert f"%{{_mandir}}/man{section}/{page.name}*\n" in rpm_files, page.name
    for prog in SCRIPTS:
        for made, debian_path, rpm_path in (
            (
                f"{prog}.bash",
                f"/usr/share/bash-completion/completions/{prog}",
                f"/usr/share/bash-completion/completions/{prog}",
            ),
            (f"_{prog}", f"/usr/share/zsh/vendor-completions/_{prog}", f"/usr/share/zsh/site-functions/_{prog}"),
        ):
            assert f"generated/completions/{made} debian/gpukill{debian_path}\n" in debian, made
            assert f"generated/completions/{made} %{{buildroot}}{rpm_path}\n" in rpm, made
            assert f"{rpm_path}\n" in rpm_files, made
    makefile = (REPO / "Makefile").read_text()
    assert "packaging/completions.py $(BUILD)/src/generated/completions" in makefile


@pytest.mark.parametrize("page", sorted(p.name for p in MAN.glob("*.[1-8]")))
def test_each_page_renders_without_warnings(page):
    """As man shows it on an 80-column terminal (line length 78): a table wider than that is a warning too."""
    groff = shutil.which("groff")
    if groff is None:
        pytest.skip("groff is not installed (Debian package groff-base)")
    r = subprocess.run(
        [groff, "-t", "-man", "-ww", "-z", "-rLL=78n", str(MAN / page)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and not r.stderr, r.stderr
