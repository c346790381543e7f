"""A kill's checkpoint step: before SIGTERM, the processes that declared a checkpoint signal (gpukill/checkpoint.py)
get it through their pidfd, and their exit is awaited up to the declared time, capped by the policy's
max_checkpoint_wait. A process that declared nothing gets no signal here; one whose declaration is malformed
neither (it asked for something that cannot be done), and the journal says why once.

Of a batch (a tree, a unit), the leaders get the signal: the declaring processes whose parent is not a declaring
GPU process (children inherit the environment, so a trainer's workers declare what it declared, and the trainer
saves for them). With `:each`, every declaring member gets it. All are awaited together, for the largest of
their capped waits.

Guard sends the signal earlier, when a kill rule's grace begins (ask()); its kill then awaits what is left of
the wait (await_asked()). The waits run on the loop (a pidfd is readable once its process exits); /proc is read
in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpukill.checkpoint import DEFAULT_MAX_WAIT, FROM_SLURM, BadDeclaration, Declaration
from gpukill.records.reclaim import (
    CHECKPOINTS_OFF,
    LED,
    MALFORMED,
    SAVED,
    STILL_RUNNING,
    UNDECLARED,
    CheckpointStep,
)
from gpukill.text import shown
from gpukill.units import format_duration

from .. import journal
from ..model import Snapshot
from ..proc.procfs import ProcFS
from .killer import Killer, PinnedProcess
from .slurm import SlurmError

SENT, WOULD_SEND = "sent", "would-send"  # GPUKILL_CHECKPOINT of the entry written when the signal goes (or would)
UNDECLARED_TEXT = "declared no checkpoint signal"
OFF_TEXT = "checkpoint signals are off (max_checkpoint_wait is 0)"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Asked:
    """A checkpoint signal sent to a process ahead of its kill (or, in a dry run, that would have been)."""

    pid: int
    start_time: int
    comm: str
    declaration: Declaration
    wait: float  # seconds its exit is awaited: the declared wait, capped
    sent_at: float  # time.monotonic() when it was sent

    def left(self, now: float) -> float:
        return max(0.0, self.wait - (now - self.sent_at))


def asked_text(asked: list[Asked], dry_run: bool) -> str:
    """Checkpoint signals sent (or, in a dry run, that would be) in words: "sent SIGUSR1 to PID 12 to save its
    work, waiting up to 2min", "would send SIGUSR1 to PID 12 and wait up to 2min"; "" for none."""
    if not asked:
        return ""
    sent = ", ".join(f"{a.declaration.name} to PID {a.pid}" for a in asked)
    wait = format_duration(max(a.wait for a in asked))
    return f"would send {sent} and wait up to {wait}" if dry_run else f"sent {sent} to save, waiting up to {wait}"


def _seconds(s: float) -> str:
    return f"{s:.1f} s"


def leaders(procfs: ProcFS, found: dict[int, Declaration], on_gpu: frozenset[int]) -> tuple[list[int], dict[int, int]]:
    """Which declaring processes get the signal: each one whose declaration says `each`, and the others whose
    parent is no declaring GPU process (the batch's or any other: a worker inherits its trainer's environment,
    and the trainer is the one asked; a shell that exported the variable is no GPU process, so its job still
    is). Returns them, and the others with the parent that leads them. Reads /proc: in a worker thread."""
    chosen, led = [], {}
    for pid, d in found.items():
        st = procfs.stat(pid)
        parent = st.ppid if st is not None else 0
        if not d.each and (
            parent in found or (parent in on_gpu and isinstance(procfs.checkpoint(parent), Declaration))
        ):
            led[pid] = parent
        else:
            chosen.append(pid)
    return chosen, led


class Checkpoints:
    def __init__(self, killer: Killer, auditor: journal.Audit) -> None:
        self.killer = killer
        self.audit = auditor
        # The policy in force's max_checkpoint_wait; the daemon points it at Guard's policy.
        self.cap: Callable[[], float] = lambda: DEFAULT_MAX_WAIT
        # A Slurm job's declared warning signal, (signal, seconds) for the job of that uid (acts/slurm.py); None:
        # no Slurm here, only environments and rules declare.
        self.job_signal: Callable[[str, int], Awaitable[tuple[int, float] | None]] | None = None

    def _declarations(self, targets: list[PinnedProcess]) -> dict[int, Declaration | BadDeclaration]:
        """Each target's own declaration (its environment), where it makes one. Worker thread."""
        out: dict[int, Declaration | BadDeclaration] = {}
        for t in targets:
            own = self.killer.procfs.checkpoint(t.pid)
            if own is not None:
                out[t.pid] = own
        return out

    async def _found(
        self, targets: list[PinnedProcess], snapshot: Snapshot, policy: Declaration | None
    ) -> dict[int, Declaration | BadDeclaration]:
        """Each target's declaration, the first source found: its environment, its Slurm job's batch script (a job
        of the process's own owner), the rule's; a malformed one stays the error (nothing replaces what the
        process asked for)."""
        found = await asyncio.to_thread(self._declarations, targets)
        jobs: dict[tuple[str, int], Declaration | None] = {}
        for t in targets:
            if t.pid in found:
                continue
            listed = snapshot.processes_of(t.pid, t.start_time)
            job = listed[0].slurm_job if listed else None
            if job and self.job_signal is not None:
                if (job, t.uid) not in jobs:
                    jobs[(job, t.uid)] = await self._job_declaration(job, t.uid)
                if (from_job := jobs[(job, t.uid)]) is not None:
                    found[t.pid] = from_job
                    continue
            if policy is not None:
                found[t.pid] = policy
        return found

    async def _job_declaration(self, job: str, uid: int) -> Declaration | None:
        """The job's `#SBATCH --signal` as a declaration; None where it declares none or Slurm cannot say."""
        assert self.job_signal is not None
        try:
            said = await self.job_signal(job, uid)
        except SlurmError as e:  # Slurm absent, failed, another user's job: as if it declared nothing
            log.info("no checkpoint signal read for Slurm job %s: %s", job, e)
            return None
        return None if said is None else Declaration(said[0], said[1], False, FROM_SLURM)

    def _log(self, step: str, target: PinnedProcess, message: str, fields: dict[str, object], **more: object) -> None:
        self.audit.log(
            journal.CHECKPOINT,
            message,
            checkpoint=step,
            target_pid=target.pid,
            target_start_time=target.start_time,
            target_uid=target.uid,
            target_comm=target.comm,
            **{k: v for k, v in fields.items() if k in ("initiator", "caller_uid", "caller_pid", "selection", "rule")},
            **more,
        )

    @staticmethod
    def _label(target: PinnedProcess) -> str:
        return f"PID {target.pid} ({shown(target.comm)}, user {shown(target.user)})"

    async def _send(
        self,
        targets: list[PinnedProcess],
        snapshot: Snapshot,
        policy: Declaration | None,
        fields: dict[int, dict[str, object]],
        dry_run: bool = False,
    ) -> tuple[list[tuple[PinnedProcess, Declaration]], dict[int, BadDeclaration], dict[int, int]]:
        """Send each chosen target its declared signal (none in a dry run): what went to whom, the malformed
        declarations, and the declaring targets left to their leader (by PID: the leader's PID)."""
        found = await self._found(targets, snapshot, policy)
        bad = {pid: d for pid, d in found.items() if isinstance(d, BadDeclaration)}
        good = {pid: d for pid, d in found.items() if isinstance(d, Declaration)}
        for t in targets:
            if t.pid in bad:
                self._log(
                    MALFORMED,
                    t,
                    f"{self._label(t)} declares a checkpoint that cannot be followed: {bad[t.pid]}; no signal sent",
                    fields.get(t.pid, {}),
                    error=str(bad[t.pid]),
                )
        on_gpu = frozenset(p.pid for p in snapshot.processes)
        chosen_list, led = await asyncio.to_thread(leaders, self.killer.procfs, good, on_gpu) if good else ([], {})
        chosen = set(chosen_list)
        cap = self.cap()
        sent = []
        for t in targets:
            if t.pid not in chosen:
                continue
            d = good[t.pid]
            wait = d.capped(cap)
            how = dict(signal=d.name, wait=f"{wait:g}", source=d.source)
            if dry_run:
                self._log(
                    WOULD_SEND,
                    t,
                    f"{self._label(t)} would get {d.name} and up to {format_duration(wait)} to save (dry run)",
                    fields.get(t.pid, {}),
                    **how,
                )
                sent.append((t, d))
            elif self.killer.send(t, d.signal):
                self._log(
                    SENT,
                    t,
                    f"{self._label(t)} sent {d.name} to save its work; up to {format_duration(wait)} to exit",
                    fields.get(t.pid, {}),
                    **how,
                )
                sent.append((t, d))
        return sent, bad, led

    async def _await(
        self,
        sent: list[tuple[PinnedProcess, Declaration]],
        wait: float,
        fields: dict[int, dict[str, object]],
        started: float,
    ) -> CheckpointStep:
        """Await the exits of the processes sent a signal, all together, for up to `wait` seconds from now;
        journal what became of each; the step's record. started: when the signals were sent."""
        exits = await self.killer.wait_all([t for t, _ in sent], wait)
        waited = time.monotonic() - started
        for (t, d), gone in zip(sent, exits, strict=True):
            if gone:
                message = f"{self._label(t)} exited after {d.name} within {_seconds(waited)}"
            else:
                message = f"{self._label(t)} still running {_seconds(waited)} after {d.name}: SIGTERM follows"
            self._log(
                SAVED if gone else STILL_RUNNING,
                t,
                message,
                fields.get(t.pid, {}),
                signal=d.name,
                waited=f"{waited:.3f}",
                source=d.source,
            )
        first = sent[0][1]
        pids = ", ".join(str(t.pid) for t, _ in sent)
        if all(exits):
            result, text = SAVED, f"{first.name} sent to PID {pids}: exited after saving ({_seconds(waited)})"
        else:
            result = STILL_RUNNING
            text = f"{first.name} sent to PID {pids}: still running after {_seconds(waited)}: SIGTERM sent"
        return CheckpointStep(
            result,
            text,
            first.name,
            tuple(t.pid for t, _ in sent),
            wait,
            round(waited, 3),
            first.source,
        )

    async def before_term(
        self,
        targets: list[PinnedProcess],
        snapshot: Snapshot,
        fields: dict[int, dict[str, object]],
        policy: Declaration | None = None,
    ) -> CheckpointStep:
        """The whole step for a kill that asks for it: send, await, say what happened. Never raises for a
        missing or malformed declaration. policy: a Guard rule's checkpoint, for targets declaring none."""
        cap = self.cap()
        if cap <= 0:
            return CheckpointStep(CHECKPOINTS_OFF, OFF_TEXT)
        started = time.monotonic()
        sent, bad, led = await self._send(targets, snapshot, policy, fields)
        if not sent:
            if led:
                pid, parent = next(iter(led.items()))
                text = f"PID {pid} inherits its checkpoint from PID {parent}, which leads it: none sent to PID {pid}"
                return CheckpointStep(LED, text)
            if bad:
                pid, error = next(iter(bad.items()))
                text = f"PID {pid} declared a checkpoint that cannot be followed ({error}): no signal sent"
                return CheckpointStep(MALFORMED, text, error=str(error))
            return CheckpointStep(UNDECLARED, UNDECLARED_TEXT)
        return await self._await(sent, max(d.capped(cap) for _, d in sent), fields, started)

    async def await_asked(
        self, targets: list[PinnedProcess], asked: dict[tuple[int, int], Asked], fields: dict[int, dict[str, object]]
    ) -> CheckpointStep | None:
        """For a kill whose targets were sent their signal earlier (Guard, at the grace's start): await what is
        left of the longest wait. None when none of the targets was asked."""
        mine = [(t, asked[(t.pid, t.start_time)]) for t in targets if (t.pid, t.start_time) in asked]
        if not mine:
            return None
        now = time.monotonic()
        left = max(a.left(now) for _, a in mine)
        return await self._await([(t, a.declaration) for t, a in mine], left, fields, min(a.sent_at for _, a in mine))

    async def ask(
        self,
        targets: list[PinnedProcess],
        snapshot: Snapshot,
        fields: dict[int, dict[str, object]],
        policy: Declaration | None,
        dry_run: bool,
    ) -> list[Asked]:
        """Send the targets that declare their checkpoint signal now, and return what was asked (in a dry run,
        what would have been: nothing is sent). Their kill later awaits the rest of the wait."""
        cap = self.cap()
        if cap <= 0:
            return []
        sent, _, _ = await self._send(targets, snapshot, policy, fields, dry_run=dry_run)
        now = time.monotonic()
        return [Asked(t.pid, t.start_time, t.comm, d, d.capped(cap), now) for t, d in sent]
