"""Every one of gpu-kill's flags, and every example command line of its README and DETAILED.md, run through
`gpukill` (tests/data/gpu-kill/: the flags from its src/args.rs, the examples from its docs, as data).

Each either works, checked by its effect (the client calls gpukillctl makes for it, recorded; JSON parsed; for
a gpukillctl command that runs on its own, the command line gpukillctl's parser takes), or is refused in one
line that names a gpukillctl command that exists (checked against gpukillctl's parser). The counts of each are
the README's (its "Coming from gpu-kill" section says them). A representative few run end to end on the test
bed: a process gone, JSON parsed, a policy in `gpukillctl guard policy list`, journal entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import http_server, sshd
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, ROOT
from helpers.waiting import wait_until
from test_gpukill_compat import (
    EXPORTED_POLICIES,
    EXPORTED_SETTINGS,
    GUARD_JSON,
    PROCESSES,
    ROGUE_TOML,
    RecordingClient,
    gpukillctl_commands,
    missing_in_gpukillctl,
    proc,
    watch_until,
)

from gpukill.records.manager import Device
from gpukillctl.cli import compat
from gpukillctl.cli import main as cli
from gpukillctl.client.exits import EXIT_OK, EXIT_USAGE
from gpukilld import journal as audit

DATA = REPO / "tests" / "data" / "gpu-kill"
SHELL = (">", ">>", "|")
# the recording client's processes, with the PIDs gpu-kill's examples name (12345, 1234), "python" ones among them
EXAMPLE_PROCESSES = [
    *PROCESSES,
    proc(12345, 999, "python"),
    proc(1234, 555, "train", device=1),
]  # where an example's gpukill command line ends and the shell's part begins


def data_lines(name: str) -> list[str]:
    return [line for line in (DATA / name).read_text().splitlines() if line and not line.startswith("#")]


FLAGS = data_lines("flags.txt")
EXAMPLES = [(where, command) for where, command in (line.split("\t") for line in data_lines("examples.txt"))]

# The smallest command line gpu-kill accepts for each flag (after `gpukill`), and what gpukill must do with it:
# the names of the client calls it makes, in order ("serve": gpukillctl serve runs, as the parser takes it), or
# "refused". A --guard-add-* takes one limit: a policy here has the limits it names, and with none gpukill is
# refused naming gpu-kill's defaults (test_gpukill_compat.py).
LISTING = ("list_devices", "list_processes")
SMALLEST: dict[str, tuple[str, tuple[str, ...] | str]] = {
    "--log-level": ("--list --log-level debug", "refused"),
    "--config": ("--list --config /etc/gpukill.toml", "refused"),
    "--dry-run": ("--kill --pid 4343 --dry-run", ("list_processes",)),
    "--safe": ("--kill --pid 4343 --safe", ("list_processes",)),
    "--list": ("--list", LISTING),
    "--kill": ("--kill --pid 4343", ("list_processes", "kill")),
    "--reset": ("--reset --gpu 0", ("reset",)),
    "--audit": ("--audit", ("usage",)),
    "--server": ("--server", "serve"),
    "--open": ("--server --open", "serve"),
    "--details": ("--list --details", LISTING),
    "--watch": ("--list --watch", LISTING * 2),
    "--output": ("--list --output json", LISTING),
    "--pid": ("--kill --pid 4343", ("list_processes", "kill")),
    "--timeout-secs": ("--kill --pid 4343 --timeout-secs 10", ("list_processes", "kill")),
    "--force": ("--kill --pid 4343 --force", ("list_processes", "kill")),
    "--gpu": ("--reset --gpu 1", ("reset",)),
    "--all": ("--reset --all", ("list_devices", "reset", "reset")),
    "--vendor": ("--list --vendor amd", LISTING),
    "--filter": ("--kill --filter python", LISTING),
    "--batch": ("--kill --filter python --batch", ("list_processes", "kill", "kill")),  # python3 and python
    "--containers": ("--list --containers", LISTING),
    "--audit-user": ("--audit --audit-user alice", ("usage",)),
    "--audit-process": ("--audit --audit-process python", ("usage",)),
    "--audit-hours": ("--audit --audit-hours 48", ("usage",)),
    "--audit-summary": ("--audit --audit-summary", ("usage", "usage")),
    "--rogue": ("--audit --rogue", ("audit_rogue",)),
    "--rogue-config": ("--audit --rogue-config", ("audit_settings",)),
    "--rogue-memory-threshold": ("--audit --rogue-memory-threshold 15", "refused"),
    "--rogue-utilization-threshold": ("--audit --rogue-utilization-threshold 90", "refused"),
    "--rogue-duration-threshold": ("--audit --rogue-duration-threshold 24", "refused"),
    "--rogue-confidence-threshold": ("--audit --rogue-confidence-threshold 0.8", ("set_audit_settings",)),
    "--rogue-whitelist-process": (
        "--audit --rogue-whitelist-process /usr/bin/my-app",
        ("audit_settings", "set_audit_settings"),
    ),
    "--rogue-unwhitelist-process": (
        "--audit --rogue-unwhitelist-process /opt/sim/bin/sim",
        ("audit_settings", "set_audit_settings"),
    ),
    "--rogue-whitelist-user": ("--audit --rogue-whitelist-user developer", ("audit_settings", "set_audit_settings")),
    "--rogue-unwhitelist-user": ("--audit --rogue-unwhitelist-user carol", ("audit_settings", "set_audit_settings")),
    "--rogue-export-config": ("--audit --rogue-export-config", ("export_audit_settings",)),
    "--rogue-import-config": ("--audit --rogue-import-config config.json", ("import_audit_settings",)),
    "--guard": ("--guard", ("guard_status",)),
    "--guard-config": ("--guard --guard-config", ("guard_status",)),
    "--guard-enable": ("--guard --guard-enable", ("guard_enable",)),
    "--guard-disable": ("--guard --guard-disable", ("guard_enable",)),
    "--guard-dry-run": ("--guard --guard-dry-run", ("guard_set_dry_run",)),
    "--guard-enforce": ("--guard --guard-enforce", ("guard_set_dry_run",)),
    "--guard-add-user": ("--guard --guard-add-user developer --guard-memory-limit 8", ("guard_set_policy",)),
    "--guard-remove-user": ("--guard --guard-remove-user developer", ("guard_remove_policy",)),
    "--guard-memory-limit": ("--guard --guard-add-user developer --guard-memory-limit 8", ("guard_set_policy",)),
    "--guard-utilization-limit": (
        "--guard --guard-add-user developer --guard-utilization-limit 70",
        ("guard_set_policy",),
    ),
    "--guard-process-limit": ("--guard --guard-add-user developer --guard-process-limit 3", ("guard_set_policy",)),
    "--guard-export-config": ("--guard --guard-export-config", ("guard_export_policies",)),
    "--guard-import-config": ("--guard --guard-import-config guard_config.json", ("guard_import_policies",)),
    "--guard-test-policies": ("--guard --guard-test-policies", ("guard_test",)),
    "--guard-toggle-dry-run": ("--guard --guard-toggle-dry-run", ("guard_status", "guard_set_dry_run")),
    "--guard-add-group": ("--guard --guard-add-group ml --guard-group-memory-limit 32", ("guard_set_policy",)),
    "--guard-remove-group": ("--guard --guard-remove-group ml", ("guard_remove_policy",)),
    "--guard-add-gpu": ("--guard --guard-add-gpu 0 --guard-gpu-memory-limit 24", ("guard_set_policy",)),
    "--guard-remove-gpu": ("--guard --guard-remove-gpu 0", ("guard_remove_policy",)),
    "--guard-group-memory-limit": ("--guard --guard-add-group ml --guard-group-memory-limit 32", ("guard_set_policy",)),
    "--guard-group-utilization-limit": (
        "--guard --guard-add-group ml --guard-group-utilization-limit 80",
        ("guard_set_policy",),
    ),
    "--guard-group-process-limit": (
        "--guard --guard-add-group ml --guard-group-process-limit 10",
        ("guard_set_policy",),
    ),
    "--guard-gpu-memory-limit": ("--guard --guard-add-gpu 0 --guard-gpu-memory-limit 24", ("guard_set_policy",)),
    "--guard-gpu-utilization-limit": (
        "--guard --guard-add-gpu 0 --guard-gpu-utilization-limit 90",
        ("guard_set_policy",),
    ),
    "--guard-gpu-reserved-memory": ("--guard --guard-add-gpu 0 --guard-gpu-reserved-memory 2", ("guard_set_policy",)),
    "--guard-group-members": ("--guard --guard-add-group ml --guard-group-members alice,bob", "refused"),
    "--guard-gpu-allowed-users": (
        "--guard --guard-add-gpu 0 --guard-gpu-allowed-users alice,bob",
        ("guard_set_policy",),
    ),
    "--server-port": ("--server --server-port 9000", "serve"),
    "--server-host": ("--server --server-host 127.0.0.1", "serve"),
    "--register-node": ("--register-node http://coordinator:8080", "refused"),
    "--remote": ("--remote gpu-host --list", LISTING),
    "--ssh-user": ("--remote gpu-host --ssh-user admin --list", LISTING),
    "--ssh-port": ("--remote gpu-host --ssh-port 2222 --list", LISTING),
    "--ssh-key": ("--remote gpu-host --ssh-key ~/.ssh/id_rsa --list", "refused"),
    "--ssh-password": ("--remote gpu-host --ssh-password secret --list", "refused"),
    "--ssh-timeout": ("--remote gpu-host --ssh-timeout 10 --list", "refused"),
    "--help": ("--help", ()),
    "--version": ("--version", ()),
}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The examples' files where they expect them: an exported configuration to import (the examples export
    to it first, as written; the flags' import lines find it already there)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compat, "WATCH_INTERVAL", 0.01)
    (tmp_path / "config.json").write_text(EXPORTED_SETTINGS)
    (tmp_path / "guard_config.json").write_text(EXPORTED_POLICIES)
    return tmp_path


class Ran:
    """A gpukill command line run as compat.main runs it, on a RecordingClient: refused, or run."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.client = RecordingClient(processes=EXAMPLE_PROCESSES)
        self.plan: compat.Plan | None = None
        self.refused = False
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            self.code = self._run()
        self.out, self.err = out.getvalue(), err.getvalue()
        self.calls = tuple(c[0] for c in self.client.calls)

    def _run(self) -> int:
        try:
            self.plan = compat.plan(self.words)
        except compat.Refused as e:
            self.refused = True
            return compat.fail(str(e), e.code)
        except SystemExit as e:  # --help, --version: printed, exit 0
            return int(e.code or 0)
        if self.plan.run is None:  # gpukillctl serve, run as it is: gpukillctl's parser must take it
            args = cli.build_parser().parse_args(list(self.plan.gpukillctl))
            return EXIT_OK if args.command == "serve" else EXIT_USAGE
        if self.plan.endless:  # --watch: a few refreshes, then stopped
            asyncio.run(watch_until(self.plan, self.client, lambda calls: len(calls) >= 3 * len(LISTING)))
            return EXIT_OK
        return asyncio.run(self.plan.run(self.client))


def check_refusal(r: Ran) -> None:
    """One line, the problem and what to run instead, and every gpukillctl command it names is one gpukillctl
    has (a refusal naming nothing, or an unknown flag's "unrecognized arguments", fails here)."""
    assert r.out == "", r.out
    assert r.err.startswith("gpukill: ") and r.err.count("\n") == 1 and "; instead: " in r.err, r.err
    assert "unrecognized arguments" not in r.err, r.err
    assert r.code == EXIT_USAGE, r.code
    instead = r.err.split("; instead: ", 1)[1]
    commands = gpukillctl_commands(instead)
    assert commands, f"names no gpukillctl command: {r.err}"
    for words in commands:
        assert missing_in_gpukillctl(words) is None, (r.err, missing_in_gpukillctl(words))


def check_works(r: Ran) -> None:
    """Exit 0 and an effect: client calls made (JSON output parsed), gpukillctl serve's command line, or the
    help or version printed."""
    assert r.code == EXIT_OK, (r.code, r.err)
    if r.words in (["--help"], ["--version"]):
        assert r.out.startswith("usage: gpukill" if r.words == ["--help"] else "gpukill "), r.out
        return
    assert r.plan is not None
    if r.plan.run is None:
        assert r.plan.gpukillctl[0] == "serve"
        return
    assert r.calls, "no call made"
    if "json" in r.words and "--output" in r.words:
        for line in r.out.splitlines():
            json.loads(line)
    if "--remote" in r.words:
        remote = r.words[r.words.index("--remote") + 1]
        assert r.plan.host is not None and remote in r.plan.host  # gpukillctl -H HOST


def outcome(r: Ran) -> str:
    if r.refused:
        check_refusal(r)
        return "refused"
    check_works(r)
    return "works"


def test_the_data_is_gpu_kills():
    assert len(FLAGS) == 76 and len(set(FLAGS)) == 76
    assert set(SMALLEST) == set(FLAGS)
    assert len(EXAMPLES) == len({c for _, c in EXAMPLES}) == 100
    assert all(
        c.startswith("gpukill") and re.fullmatch(r"(README|DETAILED)\.md:\d+(,(README|DETAILED)\.md:\d+)*", w)
        for w, c in EXAMPLES
    )


@pytest.mark.parametrize("flag", FLAGS)
def test_each_flag(flag, in_tmp):
    """The smallest command line gpu-kill accepts for the flag: refused with a pointer, or the calls it makes."""
    line, expected = SMALLEST[flag]
    r = Ran(shlex.split(line))
    got = outcome(r)
    if expected == "refused":
        assert got == "refused", (r.code, r.out, r.err)
        assert flag in r.err, r.err  # the refusal is about that flag
    else:
        assert got == "works", r.err
        if expected == "serve":
            assert r.plan.run is None and r.plan.gpukillctl[0] == "serve"
        else:
            assert r.calls[: len(expected)] == expected, r.calls


def example_words(command: str) -> tuple[list[str], str | None]:
    """The words after `gpukill`, and the file a `> FILE` sends the output to (a pipe's reader is the shell's)."""
    words = shlex.split(command)[1:]
    cut = next((i for i, w in enumerate(words) if w in SHELL), len(words))
    target = words[cut + 1] if cut < len(words) and words[cut] in (">", ">>") else None
    return [str(Path(w).expanduser()) if w.startswith("~/") else w for w in words[:cut]], target


def run_examples(directory: Path) -> list[tuple[str, str, Ran]]:
    """Every example in order (an export writes the file a later import reads, as in gpu-kill's docs)."""
    results = []
    for where, command in EXAMPLES:
        words, target = example_words(command)
        r = Ran(words)
        if target is not None and not r.refused:
            (directory / target).write_text(r.out)
        results.append((where, command, r))
    return results


# Options whose effect depends on the operation they go with: an example is checked by its operation instead.
MODIFIERS = {
    "--gpu",
    "--force",
    "--pid",
    "--timeout-secs",
    "--filter",
    "--batch",
    "--details",
    "--watch",
    "--output",
    "--vendor",
    "--containers",
    "--remote",
    "--ssh-user",
    "--ssh-port",
    "--dry-run",
    "--safe",
    "--all",
    "--list",
    "--kill",
    "--reset",
    "--guard",
    "--audit",
    "--server",
}


def expected_calls(words: list[str]) -> set[str]:
    """What a working example must have called: its operation's call (a kill, unless a preview; a reset; a
    listing), and for each other flag the call its smallest command line makes."""
    words = compat.shorthand(words)
    wanted = set()
    if "--kill" in words:
        preview = "--dry-run" in words or "--safe" in words or ("--pid" not in words and "--batch" not in words)
        wanted.add("list_processes" if preview else "kill")
    if "--reset" in words:
        wanted.add("reset")
    if "--list" in words:
        wanted.add("list_devices")
    for word in words:
        calls = SMALLEST.get(word, (None, None))[1]
        if word not in MODIFIERS and isinstance(calls, tuple) and calls:
            wanted.add(calls[-1])
    return wanted


def test_each_example(in_tmp):
    """Each example as written: works (by its effect: the calls its operation and flags make) or is refused with
    what to run instead."""
    failures = []
    for where, command, r in run_examples(in_tmp):
        try:
            if outcome(r) == "works" and r.plan is not None and r.plan.run is not None:
                missing = expected_calls(r.words) - set(r.calls)
                assert not missing, f"no {sorted(missing)} among {r.calls}"
        except AssertionError as e:
            failures.append(f"{where}: {command}: {e}")
    assert not failures, "\n".join(failures)


def counts(results) -> dict[str, int]:
    tally = {"works": 0, "refused": 0}
    for r in results:
        tally[outcome(r)] += 1
    return tally


README_COUNTS = re.compile(
    r"Of gpu-kill's (\d+) flags, (\d+) work and (\d+) are refused[^.]*; of the (\d+) example "
    r"command lines in its README and DETAILED\.md, (\d+) work and (\d+) are refused"
)


def test_the_readme_says_the_counts(in_tmp, capsys):
    flags = counts(Ran(shlex.split(SMALLEST[f][0])) for f in FLAGS)
    examples = counts(r for _, _, r in run_examples(in_tmp))
    with capsys.disabled():
        print(
            f"\ngpu-kill's {len(FLAGS)} flags: {flags['works']} work, {flags['refused']} refused with a pointer; "
            f"its {len(EXAMPLES)} examples: {examples['works']} work, {examples['refused']} refused with the "
            "equivalent"
        )
    readme = " ".join((REPO / "docs" / "using.md").read_text().split())  # the sentence may wrap
    m = README_COUNTS.search(readme)
    assert m, "docs/using.md's gpukill section does not say the counts"
    assert tuple(map(int, m.groups())) == (
        len(FLAGS),
        flags["works"],
        flags["refused"],
        len(EXAMPLES),
        examples["works"],
        examples["refused"],
    )
    man = " ".join((REPO / "man" / "gpukill.1").read_text().split())
    assert f"{flags['works']} work" in man and f"{examples['works']} work" in man


def test_vendor_shows_that_vendors_gpus_and_their_processes_only(capsys):
    """--vendor is a filter on Device.vendor: the other GPUs and the processes on them are not listed."""
    r = Ran(["--list", "--vendor", "amd", "--output", "json"])
    doc = json.loads(r.out)
    assert [d["index"] for d in doc["devices"]] == [1]
    assert {p["device"] for p in doc["processes"]} == {1}
    r = Ran(["--list", "--vendor", "apple"])  # gpu-kill's vendor that this host has none of
    assert r.code == 0 and r.out.startswith("No GPUs.") and "No GPU processes." in r.out
    assert Device  # (the RecordingClient's GPUs: 0 nvidia, 1 amd)


# -- end to end: the real daemon on the test bed ----------------------------------------------------------------


@needs_root
def test_shorthand_pid_kills_it(victims, users, alive):
    bed, owner = victims, users["owner"]
    victim = bed.victim(owner, gpu=0, comm="shorthand")
    bed.wait_listed(victim.pid, comm="shorthand")
    r = bed.gpukill(owner, str(victim.pid))  # gpu-kill's cheat sheet: gpukill 12345
    assert r.returncode == 0, r
    assert not alive(victim.pid)


@needs_root
def test_vendor_json_end_to_end(victims, users):
    bed = victims
    on_amd = bed.victim(users["owner"], gpu=2, comm="onamd")
    elsewhere = bed.victim(users["owner"], gpu=0, comm="onnvidia")
    bed.wait_listed(on_amd.pid, comm="onamd")
    bed.wait_listed(elsewhere.pid, comm="onnvidia")
    r = bed.gpukill(users["other"], "--list", "--vendor", "amd", "--output", "json")
    assert r.returncode == 0, r
    doc = json.loads(r.stdout)
    assert doc["devices"] and all(d["vendor"] == "amd" for d in doc["devices"])
    pids = {p["pid"] for p in doc["processes"]}
    assert on_amd.pid in pids and elsewhere.pid not in pids


def policies(bed) -> dict[tuple[str, str], dict]:
    r = bed.ctl(ROOT, "guard", "policy", "list", "--json")
    assert r.returncode == 0, r
    doc = json.loads(r.stdout)
    return {(p["kind"], p["target"]): p for p in (doc["policies"] if isinstance(doc, dict) else doc)}


@needs_root
def test_user_policy_flags_end_to_end(bed, users, tmp_path):
    """DETAILED.md's user policy lines, as written: the policy is in gpukillctl guard policy list, each change
    is in the journal, a user is refused by polkit, export then import round-trips."""
    add = [
        "--guard",
        "--guard-add-user",
        "gpkother",
        "--guard-memory-limit",
        "8.0",
        "--guard-utilization-limit",
        "70.0",
        "--guard-process-limit",
        "3",
    ]
    denied = bed.gpukill(users["other"], *add)
    assert denied.returncode == 4 and ("gpkother", "user") not in policies(bed), denied
    try:
        r = bed.gpukill(ROOT, *add)
        assert r.returncode == 0, r
        p = policies(bed)[("user", "gpkother")]
        assert (p["memory_limit"], p["utilization_limit"], p["process_limit"]) == (8 << 30, 70.0, 3)
        assert bed.wait_journal(MESSAGE_ID=audit.GUARD_MANAGED_POLICY.message_id, GPUKILL_POLICY_TARGET="gpkother")
        exported = bed.gpukill(ROOT, "--guard", "--guard-export-config")
        assert exported.returncode == 0 and "gpkother" in exported.stdout, exported
        saved = tmp_path / "guard_config.json"
        saved.write_text(exported.stdout)
        saved.chmod(0o644)
        tmp_path.chmod(0o755)
        r = bed.gpukill(ROOT, "--guard", "--guard-remove-user", "gpkother")
        assert r.returncode == 0 and ("user", "gpkother") not in policies(bed), r
        r = bed.gpukill(ROOT, "--guard", "--guard-import-config", str(saved))
        assert r.returncode == 0, r
        assert policies(bed)[("user", "gpkother")]["memory_limit"] == 8 << 30
        again = bed.gpukill(ROOT, "--guard", "--guard-export-config")
        assert again.stdout == exported.stdout  # byte-equal
    finally:
        bed.gpukill(ROOT, "--guard", "--guard-remove-user", "gpkother")


@needs_root
def test_gpu_kills_own_files_import_end_to_end(bed, users, tmp_path):
    """gpu-kill's Guard Mode export and its rogue_config.toml, imported into the real daemon: its policies are
    gpukilld's managed ones with the same limits; its confidence threshold and user whitelist the audit's."""
    tmp_path.chmod(0o755)
    before = bed.ctl(ROOT, "guard", "policy", "export")
    settings_before = bed.ctl(ROOT, "audit", "settings", "export")
    assert before.returncode == 0 and settings_before.returncode == 0
    saved, saved_settings = tmp_path / "before.yaml", tmp_path / "before.conf"
    saved.write_text(before.stdout)
    saved_settings.write_text(settings_before.stdout)
    try:
        r = bed.gpukill(ROOT, "--guard", "--guard-import-config", str(GUARD_JSON))
        assert r.returncode == 0 and "3 policies" in r.stdout, r
        assert f"{GUARD_JSON}: group_policies.*.members ignored" in r.stderr
        p = policies(bed)
        assert (p[("user", "alice")]["memory_limit"], p[("user", "alice")]["process_limit"]) == (8 << 30, 3)
        assert p[("group", "ml")]["memory_limit"] == 32 << 30 and p[("gpu", "0")]["reserved_memory"] == 2 << 30
        assert p[("gpu", "0")]["grace"] == 300.0
        r = bed.gpukill(ROOT, "--audit", "--rogue-import-config", str(ROGUE_TOML))
        assert r.returncode == 0, r
        shown = json.loads(bed.ctl(ROOT, "audit", "settings", "show", "--json").stdout)["settings"]
        assert shown["min_score"] == 70.0 and sorted(shown["allowed_users"]) == ["admin", "root", "system"], shown
    finally:
        saved.chmod(0o644)
        saved_settings.chmod(0o644)
        bed.ctl(ROOT, "guard", "policy", "import", str(saved), "--replace")
        bed.ctl(ROOT, "audit", "settings", "import", str(saved_settings))


@needs_root
def test_toggle_dry_run_end_to_end(bed):
    def dry_run() -> bool:
        r = bed.ctl(ROOT, "guard", "status", "--json")
        return json.loads(r.stdout)["dry_run"]

    before = dry_run()
    try:
        r = bed.gpukill(ROOT, "--guard", "--guard-toggle-dry-run")
        assert r.returncode == 0, r
        assert dry_run() is not before
        assert f"guard dry run {'off' if before else 'on'}" in r.stdout
    finally:
        bed.ctl(ROOT, "guard", "dry-run", "on" if before else "off")


@needs_root
def test_rogue_settings_flags_end_to_end(bed, users):
    """--rogue-whitelist-user and --rogue-confidence-threshold change the daemon's audit settings (journal entry
    each); put back after."""

    def settings() -> dict:
        r = bed.ctl(ROOT, "audit", "settings", "show", "--json")
        assert r.returncode == 0, r
        return json.loads(r.stdout)["settings"]

    before = settings()
    try:
        r = bed.gpukill(ROOT, "--audit", "--rogue-whitelist-user", "gpkother", "--rogue-confidence-threshold", "0.5")
        assert r.returncode == 0, r
        now = settings()
        assert "gpkother" in now["allowed_users"] and now["min_score"] == 50
        assert bed.wait_journal(MESSAGE_ID=audit.AUDIT_SETTINGS.message_id)
        denied = bed.gpukill(users["other"], "--audit", "--rogue-unwhitelist-user", "gpkother")
        assert denied.returncode == 4 and "gpkother" in settings()["allowed_users"], denied
        r = bed.gpukill(ROOT, "--audit", "--rogue-unwhitelist-user", "gpkother")
        assert r.returncode == 0 and "gpkother" not in settings()["allowed_users"], r
        r = bed.gpukill(
            users["other"], "--audit", "--rogue", "--rogue-confidence-threshold", "0.99", "--output", "json"
        )
        assert r.returncode == 0 and all(f["score"] >= 99 for f in json.loads(r.stdout)["findings"]), r
    finally:
        bed.ctl(
            ROOT,
            "audit",
            "settings",
            "set",
            f"min_score={before['min_score']}",
            f"allowed_users={','.join(before['allowed_users'])}",
        )


@pytest.fixture(scope="module")
def sshd_server(users):
    """A private sshd on loopback (helpers/sshd.py) for --remote, as tests/test_remote.py has for -H."""
    yield from sshd.serving(users["owner"].name)


@needs_root
def test_remote_with_ssh_user_and_port_end_to_end(victims, users, sshd_server, alive):
    """DETAILED.md's `--remote server --ssh-user admin --ssh-port 2222 --list` and `--remote ... --kill --pid`:
    over ssh to the bed (nothing reaches it but through ssh), as the ssh user, journaled as that user."""
    bed, owner = victims, users["owner"]
    victim = bed.victim(owner, gpu=1, comm="overssh")
    bed.wait_listed(victim.pid, comm="overssh")
    env = {
        **sshd_server.client_env(),
        "GPUKILL_REMOTE_BUS": bed.bus_address,
        "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent/system_bus_socket",
    }
    remote = ["--remote", "localhost", "--ssh-user", owner.name, "--ssh-port", str(sshd_server.port)]
    r = bed.run_as(ROOT, [PYTHON, "-m", "gpukillctl.cli.compat", *remote, "--list", "--output", "json"], env=env)
    assert r.returncode == 0, (r.stderr, sshd_server.log())
    assert victim.pid in [p["pid"] for p in json.loads(r.stdout)["processes"]]
    r = bed.run_as(ROOT, [PYTHON, "-m", "gpukillctl.cli.compat", *remote, "--kill", "--pid", str(victim.pid)], env=env)
    assert r.returncode == 0, (r.stderr, sshd_server.log())
    assert victim.wait(10) is not None and not alive(victim.pid)
    entry = bed.wait_journal(GPUKILL_TARGET_PID=str(victim.pid), MESSAGE_ID=audit.KILL.message_id)
    assert entry and entry[0]["GPUKILL_CALLER_UID"] == str(owner.uid)


@needs_root
def test_server_port_serves_the_rest_api_end_to_end(bed, users):
    """gpu-kill's `--server --server-port 9000`: gpukillctl serve on 127.0.0.1:PORT, the REST API answering with
    its token; the difference from gpu-kill (loopback, not 0.0.0.0) said on stderr."""
    owner = users["owner"]
    port = http_server.free_port()
    runtime = http_server.runtime_dir(bed, owner)
    log = bed.workdir / f"gpukill-server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PYTHON, "-m", "gpukillctl.cli.compat", "--server", "--server-port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
            env=bed.env(XDG_RUNTIME_DIR=str(runtime)),
            start_new_session=True,
            **owner.popen_kwargs(),
        )
    bed.procs.append(proc)
    token_file = runtime / "gpukill" / f"serve-{port}.token"
    try:

        def answering() -> bool:
            assert proc.poll() is None, log.read_text(errors="replace")
            return (
                token_file.exists()
                and http_server.request(port, "GET", "/v1/devices", token=token_file.read_text().strip()).status == 200
            )

        wait_until(answering, 30, lambda: log.read_text(errors="replace"), interval=0.2)
        devices = http_server.request(port, "GET", "/v1/devices", token=token_file.read_text().strip()).body
        assert devices and "devices" in devices
        assert f"gpukill: on 127.0.0.1:{port}, loopback only, not on gpu-kill's 0.0.0.0" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(15)
