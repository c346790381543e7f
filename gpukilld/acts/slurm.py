"""Slurm's own commands, run by gpukilld for Guard's `requeue` and `cancel`: the only place the daemon asks
Slurm to act on a job. A job is requeued or cancelled through Slurm rather than by signalling its processes, so
its accounting, its epilog and its requeue stay Slurm's.

- `job_info(job)`: `scontrol show job -o JOB`, one line of KEY=VALUE fields, read into a JobInfo (state,
  Requeue=0/1, owner, batch host).
- `requeue(job, uid)`: `scontrol requeue JOB`, only for a job that Slurm says is requeueable (Requeue=1) and
  whose owner is `uid` (the process's); otherwise a refusal with the reason, and nothing is asked of Slurm.
- `cancel(job, uid)`: `scancel JOB`, for a job of `uid`: Slurm's own TERM, KillWait, KILL, then the epilog.
- `slurm_checkpoint(job)`: the warning signal a job declared with `#SBATCH --signal=[{R|B}:]SIG[@SECONDS]` in its
  batch script (`scontrol write batch_script JOB -`). Slurm 22.05 keeps a job's --signal in slurmctld alone:
  job_info_t has no warn_signal or warn_time, so neither `scontrol show job` (text or --json) nor squeue shows it,
  and sbatch puts it in no SLURM_* variable of the job. The script's directive and SBATCH_SIGNAL in the job's
  environment (parse_signal_option) are what root can read; a --signal given on sbatch's command line is not.

Every command runs as a subprocess with a timeout (asyncio: the main loop never waits on Slurm), with a fixed
PATH and environment, its output bounded; a host without Slurm's commands gets a one-line error that says so.
Job ids are checked before any command sees them: decimal, at most 10 digits, an array task as JOB_TASK.

The owner check matters where a job id comes from a process's environment (proctrack/linuxproc makes no job
cgroup): a task of one user's job can start a process with any SLURM_JOB_ID, and must not make Guard act on
another user's job. The fields of `scontrol show job` are read as Slurm prints them; a job's owner can put text in
some (its name, comment, paths) and so mislead the reading of their own job only.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from .children import read_bounded

SLURM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"  # where Slurm's commands are looked for
TIMEOUT = 30.0  # seconds one command may take: slurmctld answers in well under a second when it is up
MAX_OUTPUT = 64 * 1024  # bytes kept of a command's stdout and of its stderr (a batch script is cut there)
MAX_MESSAGE = 300  # characters of Slurm's message kept in an answer or a journal entry
DEFAULT_WARN_TIME = 60.0  # sbatch's --signal without @SECONDS: sixty seconds before the end
_JOB_ID = re.compile(r"[0-9]{1,10}(?:_[0-9]{1,10})?")
_FIELD = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
_OWNER = re.compile(r"(.*)\(([0-9]{1,10})\)")
_SIGNAL_OPTION = re.compile(r"(?:([RB]{1,2}):)?([A-Za-z0-9+]{1,12})(?:@([0-9]{1,5}))?")
_SBATCH_SIGNAL = re.compile(r"#SBATCH\s+--signal(?:=|\s+)(\S+)")
NEVER_DECLARED = (signal.SIGKILL, signal.SIGSTOP)  # a process cannot handle these: no checkpoint signal


class SlurmError(Exception):
    """Slurm was not asked (a refusal: a job not requeueable, of another user) or did not do it (absent,
    timed out, its command failed). `result` is GPUKILL_RESULT's word for it; the message is one line."""

    def __init__(self, result: str, message: str) -> None:
        super().__init__(message)
        self.result = result


NOT_A_JOB_ID = "invalid-job-id"
NOT_INSTALLED = "slurm-absent"
FAILED = "slurm-failed"
NOT_REQUEUEABLE = "not-requeueable"
NOT_THE_OWNER = "not-the-owner"


@dataclass(frozen=True, slots=True)
class Ran:
    """A command's exit status and output (bounded, decoded leniently)."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def message(self) -> str:
        """What Slurm said, on one line: its error where it failed, else its output."""
        text = self.stderr.strip() or self.stdout.strip()
        line = " ".join(text.split())
        return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 1] + "…"


Runner = Callable[[Sequence[str], float], Awaitable[Ran]]  # argv, timeout -> Ran; raises SlurmError


def job_id(text: str) -> str:
    """A job id as Slurm writes it (42, or 42_7 for an array task); SlurmError otherwise."""
    if not isinstance(text, str) or not _JOB_ID.fullmatch(text):
        raise SlurmError(NOT_A_JOB_ID, f"not a Slurm job id: {text!r}"[:MAX_MESSAGE])
    return text


async def run_command(argv: Sequence[str], timeout: float) -> Ran:
    """Run one of Slurm's commands: found on SLURM_PATH, with a plain environment, no stdin, killed at the timeout."""
    path = shutil.which(argv[0], path=SLURM_PATH)
    if path is None:
        raise SlurmError(NOT_INSTALLED, f"{argv[0]} not found in {SLURM_PATH}: Slurm's commands are not installed here")
    try:
        proc = await asyncio.create_subprocess_exec(
            path,
            *argv[1:],
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": SLURM_PATH, "LANG": "C"},
            cwd="/",
        )
    except OSError as e:
        raise SlurmError(FAILED, f"{argv[0]} could not be started: {e.strerror or e}") from None
    try:
        out, err = await asyncio.wait_for(
            asyncio.gather(read_bounded(proc.stdout, MAX_OUTPUT), read_bounded(proc.stderr, MAX_OUTPUT)), timeout
        )
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise SlurmError(FAILED, f"{' '.join(argv[:2])} did not answer within {timeout:g}s") from None
    return Ran(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


@dataclass(frozen=True, slots=True)
class JobInfo:
    """What `scontrol show job -o` says of a job, as far as Guard needs it."""

    job: str
    state: str  # JobState: RUNNING, PENDING, COMPLETING, ...
    requeue: bool  # Requeue=1: Slurm may requeue it (sbatch --requeue, or JobRequeue=1 and no --no-requeue)
    user: str
    uid: int | None
    batch_host: str
    restarts: int


def parse_fields(line: str) -> dict[str, str]:
    """One line of `scontrol show ... -o`: KEY=VALUE fields separated by spaces (a value may hold spaces:
    it runs to the next KEY=). The first of a key that appears twice is kept."""
    fields: dict[str, str] = {}
    found = list(_FIELD.finditer(line))
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(line)
        fields.setdefault(m.group(1), line[m.end() : end].strip())
    return fields


def parse_job(job: str, text: str) -> JobInfo:
    """The line of `scontrol show job -o JOB` that is JOB (an array's tasks each have their own line); SlurmError
    when none is."""
    for line in text.splitlines():
        f = parse_fields(line)
        task = f"{f.get('ArrayJobId')}_{f.get('ArrayTaskId')}"
        if f.get("JobId") != job and task != job:
            continue
        owner = _OWNER.fullmatch(f.get("UserId", ""))
        restarts = f.get("Restarts", "")
        return JobInfo(
            job=job,
            state=f.get("JobState", ""),
            requeue=f.get("Requeue") == "1",
            user=owner.group(1) if owner else f.get("UserId", ""),
            uid=int(owner.group(2)) if owner else None,
            batch_host=f.get("BatchHost", ""),
            restarts=int(restarts) if restarts.isdigit() else 0,
        )
    raise SlurmError(FAILED, f"scontrol show job {job} does not describe job {job}")


def parse_signal_option(text: str) -> tuple[int, float] | None:
    """sbatch's `--signal=[{R|B}:]SIG[@SECONDS]` (also SBATCH_SIGNAL's value): (signal number, seconds before
    the end; 60 where none is written), or None when it names no signal a process can handle."""
    m = _SIGNAL_OPTION.fullmatch(text.strip())
    if m is None:
        return None
    name, secs = m.group(2), m.group(3)
    if name.isdigit():
        number = int(name)
    else:
        upper = name.upper()
        try:
            number = int(signal.Signals[upper if upper.startswith("SIG") else "SIG" + upper])
        except KeyError:
            return None
    if not 0 < number < signal.NSIG or number in NEVER_DECLARED:
        return None
    return number, float(secs) if secs is not None else DEFAULT_WARN_TIME


def script_signal(script: str) -> tuple[int, float] | None:
    """The --signal of a batch script's #SBATCH directives, read as sbatch reads them: in the comments before its
    first command; the last one written wins."""
    found = None
    for line in script.splitlines()[1:]:  # the first line is the interpreter's
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        m = _SBATCH_SIGNAL.match(stripped)
        if m is not None:
            found = parse_signal_option(m.group(1))
    return found


class Slurm:
    """Slurm's commands for Guard; `run` is run_command, or a fake one in tests."""

    def __init__(self, run: Runner = run_command, timeout: float = TIMEOUT) -> None:
        self.run = run
        self.timeout = timeout

    async def _ok(self, *argv: str) -> Ran:
        ran = await self.run(argv, self.timeout)
        if ran.returncode != 0:
            raise SlurmError(FAILED, f"{argv[0]} {argv[1]}: {ran.message or f'exit status {ran.returncode}'}")
        return ran

    async def job_info(self, job: str) -> JobInfo:
        job = job_id(job)
        ran = await self._ok("scontrol", "show", "job", "-o", job)
        return parse_job(job, ran.stdout)

    async def _owned(self, job: str, uid: int, what: str) -> JobInfo:
        """The job, once it is known to be uid's: a process of one user never makes Guard act on another's job."""
        info = await self.job_info(job)
        if info.uid != uid:
            owner = f"uid {info.uid}" if info.uid is not None else "an unknown user"
            raise SlurmError(
                NOT_THE_OWNER, f"job {job} belongs to {owner}, not to the process's owner (uid {uid}): not {what}"
            )
        return info

    async def requeue(self, job: str, uid: int) -> str:
        """`scontrol requeue JOB` for a requeueable job of uid; Slurm's message ("" when it says nothing)."""
        info = await self._owned(job, uid, "requeued")
        if not info.requeue:
            raise SlurmError(
                NOT_REQUEUEABLE,
                f"job {job} is not requeueable (sbatch --no-requeue or JobRequeue=0): not requeued",
            )
        return (await self._ok("scontrol", "requeue", info.job)).message

    async def cancel(self, job: str, uid: int) -> str:
        """`scancel JOB` for a job of uid: Slurm sends TERM, waits KillWait, then KILL, and runs the epilog."""
        info = await self._owned(job, uid, "cancelled")
        return (await self._ok("scancel", info.job)).message

    async def declared_signal(self, job: str, uid: int) -> tuple[int, float] | None:
        """The checkpoint signal uid's job declares (slurm_checkpoint), for a process of uid: a process names its
        job in its environment, so another user's job is never read for it (SlurmError NOT_THE_OWNER)."""
        info = await self._owned(job, uid, "read")
        return await self.slurm_checkpoint(info.job)

    async def slurm_checkpoint(self, job: str) -> tuple[int, float] | None:
        """The warning signal and its seconds that the job's batch script declares (`#SBATCH --signal=...`), None
        where it declares none (see the module's note on what Slurm lets root read back)."""
        job = job_id(job)
        ran = await self._ok("scontrol", "write", "batch_script", job, "-")
        return script_signal(ran.stdout)
