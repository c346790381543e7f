"""`make sandbox` (examples/sandbox.py) as a person uses it: the lines it prints, pasted into another shell, reach
its gpukilld; a process started with `gpukill-sandbox run` is listed to another user; Ctrl-C leaves nothing."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import testbed
from helpers.testbed import OTHER, OWNER, PYTHON, REPO

SANDBOX = REPO / "examples" / "sandbox.py"
README = REPO / "README.md"
LOOKS = ("gpukillctl list", "gpukillctl guard test")  # commands that change nothing: asked again until listed

needs_root = pytest.mark.skipif(
    not testbed.is_root() or bool(testbed.missing_tools()),
    reason="needs root and the demo's tools: the sandbox starts a private bus, polkitd "
    "and journald, and creates test users",
)


class Output:
    """A process's stdout, read line by line as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, prefix: str | None, timeout: float = 60) -> list[str]:
        """Every line read so far and up to the one that starts with prefix (None: up to the end)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                assert prefix is None, f"the sandbox ended before printing {prefix!r}:\n" + "\n".join(self.seen)
                return self.seen
            self.seen.append(line)
            if prefix is not None and line.startswith(prefix):
                return self.seen


def pasted(lines: list[str], *commands: str) -> subprocess.CompletedProcess:
    """commands run by bash after the printed export and alias lines, as pasted into another root shell."""
    setup = [line for line in lines if line.startswith(("export ", "alias "))]
    script = "\n".join([*setup, "shopt -s expand_aliases", *commands])
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd="/", stdin=subprocess.DEVNULL
    )


def with_cmdline_naming(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.isdigit() and int(entry) != os.getpid() and text in cmdline:
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below pid (its components each lead a session of their own, but stay its children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with (task / "children").open() as f:
            children = [int(c) for c in f.read().split()]
        for child in children:
            found += [child, *descendants(child)]
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture
def sandbox():
    """examples/sandbox.py running: the process, its output, and the lines it printed up to "Ctrl-C here"."""
    proc = subprocess.Popen(
        [PYTHON, str(SANDBOX)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        output = Output(proc)
        yield proc, output, output.until("Ctrl-C here")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


@needs_root
def test_the_printed_lines_reach_the_sandbox_and_ctrl_c_leaves_nothing(sandbox):
    proc, output, lines = sandbox
    (export,) = [line for line in lines if line.startswith("export DBUS_SYSTEM_BUS_ADDRESS=")]
    workdir = Path(re.search(r"unix:path=(\S+)/system_bus_socket", export).group(1))
    (alias,) = [line for line in lines if line.startswith("alias journalctl=")]
    components = descendants(proc.pid)
    assert int(re.search(r"-t (\d+)", alias).group(1)) in components
    assert len(components) >= 4, components  # dbus-daemon, journald, polkitd, gpukilld

    r = pasted(lines, f"gpukill-sandbox run --user {OWNER} --gpu 1 --mem 3GiB --util 55 -- sleep 600")
    assert r.returncode == 0, r
    pid = int(re.fullmatch(r"PID (\d+): sleep 600 as gpkowner, on simulated GPU 1 .*\n", r.stdout).group(1))

    deadline = time.monotonic() + 15
    while True:
        r = pasted(lines, f"runuser -u {OTHER} -- gpukillctl list --json")
        assert r.returncode == 0, r
        listed = {p["pid"]: p for p in json.loads(r.stdout)["processes"]}
        if pid in listed or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert listed[pid]["user"] == OWNER and listed[pid]["device"] == 1, listed
    assert listed[pid]["gpu_memory"] == 3 << 30, listed[pid]

    r = pasted(lines, f"runuser -u {OTHER} -- gpukillctl kill {pid}")
    assert r.returncode == 4 and alive(pid), r  # another user's process: polkit says no
    r = pasted(lines, "journalctl -t gpukilld -o cat --no-pager")
    assert f"Kill of PID {pid} (sleep, user {OWNER}) denied" in r.stdout, r

    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0, proc.stderr.read()
    assert f"removed {workdir}" in output.until(None)[-1]
    assert not alive(pid)
    assert [p for p in components if alive(p)] == []
    assert not workdir.exists()
    assert with_cmdline_naming(str(workdir)) == []


def shape(text: str) -> str:
    """Output with its numbers of four digits or more (PIDs, uids), the time a kill's memory took to come back
    ("1.1s after SIGTERM": the machine's pace) and its column widths left out."""
    text = re.sub(r"\b[\d.]+(?:ms|s|min) after (SIG[A-Z0-9]+)", r"T after \1", text)
    return re.sub(r"\s+", " ", re.sub(r"\d{4,}", "N", text)).strip()


def sandbox_free(line: str) -> str:
    """A printed line without what differs from one sandbox to the next: its directory, the journal's PID."""
    return re.sub(r"\d+", "N", re.sub(r"/tmp/gpukill-sandbox-[^/]+/", "DIR/", line.strip()))


def readme_steps() -> list[tuple[str, str]]:
    """The first five minutes in order, as (kind, text): each console block's commands with the output shown
    under them ("command", "CMD\nOUTPUT"), the policy saved ("yaml"), and a command the prose gives ("command")."""
    text = README.read_text()
    section = text.split("\n## The first five minutes\n", 1)[1].split("\n## ", 1)[0]
    steps = []
    for m in re.finditer(r"^```(\w+)\n(.*?)^```|`(gpukill-sandbox run [^`]*)`", section, re.M | re.S):
        if m.group(3):
            steps.append(("command", m.group(3)))
        elif m.group(1) == "yaml":
            steps.append(("yaml", m.group(2)))
        else:
            for command in re.split(r"^# ", m.group(2), flags=re.M)[1:]:
                steps.append(("command", command))
    return steps


@needs_root
def test_the_readmes_first_five_minutes_run_as_written(sandbox, tmp_path):
    """Every command of the README's first five minutes, pasted after the sandbox's lines: it succeeds (or is
    denied where the README shows a denial) and prints what the README shows, PIDs and column widths aside."""
    _proc, _output, lines = sandbox
    os.chmod(tmp_path, 0o755)
    steps = readme_steps()
    commands = [s.split("\n", 1)[0] for kind, s in steps if kind == "command"]
    printed = [line for line in lines if line.startswith(("export ", "alias "))]
    assert [sandbox_free(c.split("  #")[0]) for c in commands[:2]] == [sandbox_free(line) for line in printed]
    pids: dict[str, str] = {}  # the README's PID -> this run's
    for kind, step in steps:
        if kind == "yaml":
            name = step.split("\n", 1)[0].removeprefix("# ")
            (tmp_path / name).write_text(step)
            continue
        command, _, shown = step.partition("\n")
        command = command.split("  #", 1)[0].strip()
        if command.startswith(("export ", "alias ")):
            continue  # the lines the sandbox printed stand for these
        for theirs, ours in pids.items():
            command = re.sub(rf"\b{theirs}\b", ours, command)
        deadline = time.monotonic() + 15
        while True:
            r = pasted(lines, f"cd {tmp_path}", command)
            if not command.startswith(LOOKS) or shape(r.stdout) == shape(shown) or time.monotonic() > deadline:
                break
            time.sleep(0.3)  # a process started is listed within a second
        denied = shown.startswith("gpukillctl: not authorized")
        assert r.returncode == (4 if denied else 0), (command, r)
        if command.startswith("gpukill-sandbox run") and shown:
            pids[re.match(r"PID (\d+):", shown).group(1)] = re.match(r"PID (\d+):", r.stdout).group(1)
        if shown and not command.startswith("journalctl"):  # the journal's figures and times differ
            assert shape(r.stdout + r.stderr) == shape(shown), (command, r.stdout + r.stderr, shown)


def test_run_without_a_sandbox_says_so_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "DBUS_SYSTEM_BUS_ADDRESS"}
    r = subprocess.run(
        [PYTHON, str(SANDBOX), "run", "--user", "root", "--", "sleep", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr == (
        "gpukill-sandbox run: DBUS_SYSTEM_BUS_ADDRESS names no running sandbox: paste the export "
        "line that `make sandbox` printed\n"
    )
