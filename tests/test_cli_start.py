"""What a one-shot gpukillctl command pays before it connects (bench/cli_start): the parser of the command asked
for alone, argparse's help width without shutil, and the same parse and help as the whole parser gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpukillctl.cli import main as cli

REPO = Path(__file__).resolve().parent.parent

LINES = (
    ["list", "--json"],
    ["list", "--device", "1", "--min-memory", "5GiB"],
    ["-H", "box", "list", "--user", "x"],
    ["kill", "12", "--force", "--grace", "2"],
    ["kill", "--job", "77"],
    ["reset", "0", "--force"],
    ["status"],
    ["guard", "status"],
    ["guard", "test", "--policy", "p.yaml"],
    ["audit", "--json"],
)


@pytest.mark.parametrize("argv", LINES, ids=" ".join)
def test_the_one_commands_parser_parses_as_the_whole_one(argv):
    word = cli.command_word(argv)
    assert word in cli.ONE_SHOT
    assert cli.build_parser(full=False, only=word).parse_args(argv) == cli.build_parser().parse_args(argv)


def test_only_builds_that_command_alone():
    sub = next(
        a for a in cli.build_parser(full=False, only="list")._actions if isinstance(a, cli.argparse._SubParsersAction)
    )
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
    probe = (
        "import sys; import gpukillctl.cli.main as c; "
        "c.build_parser(full=False, only='list').parse_args(['list', '--json']); print('shutil' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout


# What a one-shot `list` leaves unimported (gpukillctl/cli/deferred.py; the other commands' modules, imported when
# their parser is built or they run): inspect (~5.5 ms with ast, dis, tokenize) and copy are imported by
# dataclasses for calls `list` never makes, and stand in sys.modules until something uses them.
UNUSED_BY_LIST = (
    "ast",
    "dis",
    "tokenize",
    "linecache",
    "weakref",
    "gpukill.outcome",
    "gpukill.limits",
    "gpukill.records.status",
    "gpukillctl.cli.guard",
    "gpukillctl.cli.audit",
    "gpukillctl.cli.usage",
)
# After `list`: inspect and copy used through the names dataclasses took of them at its import (the stand-ins),
# and through a fresh import; each answer is compared with the real modules' (below, in this process).
LATER_USE = """
import dataclasses, json, sys

def signature_of(a, b=2, *c, d): pass

@dataclasses.dataclass
class NoDoc:  # dataclasses writes a docstring with inspect.signature for a class without one
    x: int
    y: tuple = ()

value = NoDoc(1, ([1], {"k": 2}))
plain = dataclasses.asdict(value)  # copy.deepcopy, through the name dataclasses holds
import inspect
uses = {"signature": str(inspect.signature(signature_of)), "doc": NoDoc.__doc__, "asdict": plain,
        "deep_copied": plain["y"][0] is not value.y[0], "getsource": inspect.getsource(signature_of).strip()}
"""


def list_and_use_later(env: dict[str, str], tmp_path: Path) -> tuple[int, str, dict]:
    """Run `gpukillctl list --json` in a fresh interpreter: its exit status, its stdout, what it left unloaded and
    what later uses of the deferred modules answered there."""
    probe = tmp_path / "probe.py"  # a file, for inspect.getsource
    probe.write_text(
        "import json, sys, types\n"
        "from gpukillctl.cli.main import main\n"
        "code = main(['list', '--json'])\n"
        "stand_ins = {name: sys.modules.get(name) for name in ('inspect', 'copy')}\n"
        "state = {'code': code, 'kinds': {n: type(m).__name__ for n, m in stand_ins.items()},\n"
        f"         'loaded': sorted(m for m in {UNUSED_BY_LIST!r} if m in sys.modules),\n"
        # the records it made: each dataclass compiled its generated methods at this start
        "         'dataclasses': sorted(n for m in list(sys.modules) if m.startswith('gpukill.records.')\n"
        "                               for n, v in vars(sys.modules[m]).items() if isinstance(v, type)\n"
        "                               and '__dataclass_fields__' in vars(v) and v.__module__ == m)}\n"
        + LATER_USE
        + "state['uses'] = uses\n"
        "state['replaced'] = {n: type(sys.modules[n]) is types.ModuleType and sys.modules[n] is not m\n"
        "                     for n, m in stand_ins.items()}\n"
        "state['same_names'] = stand_ins['inspect'].signature is sys.modules['inspect'].signature\n"
        "state['dir'] = 'signature' in dir(stand_ins['inspect'])\n"
        "state['missing'] = hasattr(stand_ins['inspect'], 'nonesuch')\n"
        "sys.stderr.write('PROBE ' + json.dumps(state) + '\\n')\n"
    )
    r = subprocess.run([sys.executable, str(probe)], cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    line = next((line for line in r.stderr.splitlines() if line.startswith("PROBE ")), None)
    assert line, r.stderr[-2000:]
    state = json.loads(line[len("PROBE ") :])
    return state.pop("code"), r.stdout, state


def expected_later_use(tmp_path: Path) -> dict:
    """LATER_USE's answers from the real modules (this process imported them long ago)."""
    source = tmp_path / "expected.py"
    source.write_text(LATER_USE)
    scope: dict = {}
    exec(compile(source.read_text(), str(source), "exec", dont_inherit=True), scope)  # not this file's __future__
    return json.loads(json.dumps(scope["uses"]))


def assert_deferred_until_used(state: dict, tmp_path: Path, listed: bool = True) -> None:
    """listed: the daemon answered, so the suspended processes' records were read too."""
    assert state["kinds"] == {"inspect": "DeferredModule", "copy": "DeferredModule"}, state
    assert state["loaded"] == [], f"`list` imported what it does not use: {state['loaded']}"
    # the listing's records and, once the daemon answered, the suspended processes' (their module's two); no other
    suspended = ["SuspendReply", "SuspendedProcess"] if listed else []
    assert state["dataclasses"] == ["Device", "MemoryRegion", "Process", *suspended]
    assert state["uses"] == expected_later_use(tmp_path)
    assert state["uses"]["deep_copied"] and "signature_of(a, b=2" in state["uses"]["getsource"]
    assert state["replaced"] == {"inspect": True, "copy": True}  # the real modules took the stand-ins' places
    assert state["same_names"] and state["dir"] and not state["missing"]


def test_list_defers_what_it_never_uses_without_a_bus(tmp_path):
    # the whole start of `list` up to its connect (no bus here: it stops there, exit 3)
    env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent/bus", "PYTHONPATH": str(REPO)}
    code, _, state = list_and_use_later(env, tmp_path)
    assert code == 3
    assert_deferred_until_used(state, tmp_path, listed=False)


def test_list_defers_what_it_never_uses_to_the_end(bed, tmp_path):
    # the whole of `list --json` on the testbed's gpukilld: the records, their JSON, jeepney's parse
    code, out, state = list_and_use_later(bed.env(), tmp_path)
    assert code == 0 and json.loads(out)["devices"], out[-500:]
    assert_deferred_until_used(state, tmp_path)


def test_the_daemon_gets_no_stand_in():
    # the stand-ins are the commands' alone: gpukilld's modules import the real inspect, as they always did
    probe = (
        "import sys, types; import gpukilld.main; "
        "print(type(sys.modules['inspect']) is types.ModuleType, 'gpukillctl.cli' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"], out.stdout


@pytest.mark.parametrize("argv", [["list", "--help"], ["kill", "--help"], ["guard", "--help"], ["--help"]])
def test_help_is_the_same_as_argparses_own(argv):
    # what --help writes is what argparse writes with its own formatters (which ask shutil for the width)
    env = {"COLUMNS": "70", "PATH": "/usr/bin:/bin"}
    ours = subprocess.run(
        [sys.executable, "-m", "gpukillctl", *argv], cwd=REPO, capture_output=True, text=True, env=env
    )
    plain = (
        "import argparse, sys; from gpukillctl.cli import main as cli; "
        "argparse.ArgumentParser._get_formatter = lambda self: self.formatter_class(prog=self.prog); "
        f"cli.Parser._get_formatter = argparse.ArgumentParser._get_formatter; cli.main({argv!r})"
    )
    theirs = subprocess.run([sys.executable, "-c", plain], cwd=REPO, capture_output=True, text=True, env=env)
    assert ours.returncode == theirs.returncode == 0
    assert ours.stdout == theirs.stdout and "usage:" in ours.stdout


# The packages' tree: the wrappers (packaging/bin) write no bytecode under /usr, so the package must make it where
# it is installed, with the interpreter that runs it; without it every start compiles gpukill's modules again
# (bench/cli_start's "no bytecode" row). The .deb: dh_python3's postinst runs py3compile on /usr/lib/gpukill.
# The .rpm: its %post (rpm's brp-python-bytecompile compiles only /usr/lib*/pythonX.Y; Debian's rpm not even that).
DEB_LIB = "/usr/lib/gpukill"
SPEC = REPO / "packaging" / "rpm" / "gpukill.spec"


def scriptlet(spec: str, name: str) -> str:
    return spec.split(f"\n{name}\n", 1)[1].split("\n%", 1)[0]


def rpm_compile_line() -> str:
    lines = [
        line
        for line in scriptlet(SPEC.read_text(), "%post").splitlines()
        if DEB_LIB in line and not line.lstrip().startswith("#")
    ]
    assert lines, "the .rpm's %post makes no bytecode for /usr/lib/gpukill"
    return lines[0]


def test_the_packages_make_the_trees_bytecode_where_installed():
    rules = (REPO / "packaging" / "debian" / "rules").read_text()
    # py3compile in postinst, py3clean in prerm: the main package's tree, and gpukill-serve's bundled stack
    assert (
        f"dh_python3 -pgpukill {DEB_LIB}\n" in rules
        and f"dh_python3 -pgpukill-serve --no-guessing-deps {DEB_LIB}/vendor-serve" in rules
    )
    assert "compileall" in rpm_compile_line()
    # and the .rpm takes it away on erase (it does not own those files)
    erase = scriptlet(SPEC.read_text(), "%preun")
    assert "$1 -eq 0" in erase and "__pycache__" in erase and DEB_LIB in erase


def packaged_tree(root: Path) -> tuple[Path, Path]:
    """/usr/lib/gpukill as the packages lay it out (the code; of the vendored libraries, jeepney, which the list
    path imports and which the packages take from the system), and packaging/bin/gpukillctl pointed at it."""
    import jeepney

    lib = root / "usr" / "lib" / "gpukill"
    skip = shutil.ignore_patterns("__pycache__")
    for package in ("gpukill", "gpukilld", "gpukillctl"):
        shutil.copytree(REPO / package, lib / package, ignore=skip)
    shutil.copytree(Path(jeepney.__file__).parent, lib / "vendor" / "jeepney", ignore=skip)
    wrapper = root / "usr" / "bin" / "gpukillctl"
    wrapper.parent.mkdir(parents=True)
    text = (REPO / "packaging" / "bin" / "gpukillctl").read_text()
    assert DEB_LIB in text
    wrapper.write_text(text.replace(DEB_LIB, str(lib)))
    wrapper.chmod(0o755)
    return lib, wrapper


def compiled_from_source(wrapper: Path, lib: Path) -> list[str]:
    """The modules of the tree that `gpukillctl list --json` compiled from source (no bus: it stops at connect)."""
    env = {"PATH": "/usr/bin:/bin", "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent/bus"}
    r = subprocess.run(
        ["/usr/bin/python3", "-v", str(wrapper), "list", "--json"], capture_output=True, text=True, env=env, cwd="/"
    )
    assert r.returncode == 3 and "cannot connect to the system bus" in r.stderr, r.stderr[-500:]
    return [line for line in r.stderr.splitlines() if line.startswith(f"# code object from {lib}/")]


@pytest.mark.skipif(
    not Path("/usr/bin/python3").exists(), reason="the packages' interpreter, /usr/bin/python3, is absent"
)
@pytest.mark.parametrize("package", ["deb", "rpm"])
def test_the_packaged_command_imports_its_tree_from_bytecode(tmp_path, package):
    lib, wrapper = packaged_tree(tmp_path)
    uncompiled = compiled_from_source(wrapper, lib)
    assert any("gpukillctl/cli/main.py" in line for line in uncompiled)  # what this test sees without bytecode
    if package == "deb":
        if not shutil.which("py3compile"):
            pytest.skip("py3compile (python3-minimal) is not installed")
        subprocess.run(["py3compile", str(lib)], check=True)
    else:
        # as the %post runs it: `python3` is the system's, the one the wrapper's shebang names
        subprocess.run(
            rpm_compile_line().replace(DEB_LIB, str(lib)), shell=True, check=True, env={"PATH": "/usr/bin:/bin"}
        )
    assert compiled_from_source(wrapper, lib) == []


def test_the_listing_path_builds_only_the_listings_records():
    # What `gpukillctl list --json` imports before it connects: the audit's, the Guard's and the signals'
    # records (21 of the 24 dataclasses, ~7 ms) must not come with it.
    probe = (
        "import sys; import gpukillctl.cli.main, gpukillctl.client.blocking; "
        "gpukillctl.cli.main.build_parser(full=False).parse_args(['list', '--json']); "
        "print(sorted(m for m in sys.modules if m.startswith('gpukill.records.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['gpukill.records.base', 'gpukill.records.manager']", out.stdout
