"""`gpukillctl kill`'s answer: one line for the process (or each process of a workload) and one for the GPU.

A kill is done when the GPU memory is back: the line says reclaimed, held by whom (exit status 14), or still
alive after SIGKILL with the reason and the reset that frees the GPU (exit status 10). `--tree`, `--unit`,
`--container` and `--job` go through KillWorkload: every GPU process of the workload, each pinned and authorized
by gpukilld as a single kill is, stopped together (one grace, one checkpoint step), listed with what became of
it. The Slurm epilog runs `kill --job`: it passes the lines on, reads "no GPU processes of Slurm job ..." as
nothing left behind, and drains the node on a failing exit status (14: memory still held) where
GPUKILL_EPILOG_DRAIN asks it to.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from gpukill.outcome import reclaim_text
from gpukill.text import shown

from ..client.exits import (
    EXIT_CHANGED,
    EXIT_DENIED,
    EXIT_MEMORY_HELD,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_STILL_ALIVE,
    batch_exit,
)

_ENTRY_EXIT = {
    "denied": EXIT_DENIED,
    "protected": EXIT_REFUSED,
    "not-a-gpu-process": EXIT_REFUSED,
    "still-alive": EXIT_STILL_ALIVE,
    "process-changed": EXIT_CHANGED,
}


def unit_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9:_.\\@-]+\.(service|scope)", text) or len(text) > 256:
        raise argparse.ArgumentTypeError(f"not a systemd .service or .scope name: {text!r}")
    return text


def slurm_job_id(text: str) -> str:
    """A Slurm job id as the daemon lists it (decimal); an array task's or a het job's component's own id, not
    "123_4" or "123+1" (SLURM_JOB_ID in the epilog is already the plain one)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 10):
        raise argparse.ArgumentTypeError(f"not a Slurm job id: {text!r}")
    return str(int(text))


def container_id(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{12,64}", text):
        raise argparse.ArgumentTypeError(f"not a container id (12 to 64 lowercase hex digits): {text!r}")
    return text


def outcome_line(what: str, outcome: str) -> str:
    from gpukill.outcome import Outcome

    out = Outcome(outcome)
    return f"{what} {out.text}{' after the grace period' if out == Outcome.KILLED else ''}"


def checkpoint_line(what: str, step: Any) -> None:
    """What a kill's checkpoint step did (--checkpoint), on its own line before the outcome's."""
    if step is not None:
        print(f"{what} checkpoint: {shown(step.text)}")


def answer(what: str, outcome: str, reclaim: Any, checkpoint: Any = None) -> int:
    """Print a single kill's lines (the checkpoint step's, where there was one); its exit status."""
    from gpukill.outcome import Outcome

    checkpoint_line(what, checkpoint)
    if outcome == Outcome.STILL_ALIVE and reclaim.verdict != "stuck":
        print(f"gpukillctl: {what} is {Outcome.STILL_ALIVE.text}; use --force to send SIGKILL", file=sys.stderr)
        return EXIT_STILL_ALIVE
    if reclaim.verdict == "stuck":
        print(f"gpukillctl: {what} is {reclaim_text(reclaim)}", file=sys.stderr)
        return EXIT_STILL_ALIVE
    line = f"{outcome_line(what, outcome)}; {reclaim_text(reclaim)}"
    if reclaim.verdict == "held":
        print(f"gpukillctl: {line}", file=sys.stderr)
        return EXIT_MEMORY_HELD
    print(line)
    return EXIT_OK


def workload_answer(reply: Any) -> int:
    """Print each process of a KillWorkload, then the GPU's answer; the first failure's exit status (14 when
    every process ended but memory is still held), else 0."""
    if not reply.entries and not reply.hidden:  # nothing of it runs on a GPU here: the epilog's usual case
        print(f"no GPU processes of {shown(reply.selection)} on this host")
        return EXIT_OK
    codes = []
    checkpoint_line(shown(reply.selection), reply.checkpoint)
    if reply.hidden:  # /proc hides them from the caller (hidepid): what became of them is not the caller's to see
        print(
            f"gpukillctl: {reply.hidden} processes of other users in {shown(reply.selection)} are hidden from you "
            "by /proc (hidepid): what became of them is not shown",
            file=sys.stderr,
        )
    for e in reply.entries:
        what = f"PID {e.pid} ({shown(e.comm)})"
        if not e.on_gpu:
            print(f"{what} not on a GPU: left running")
        elif e.result in ("terminated", "killed"):
            print(outcome_line(what, e.result))
        elif e.result in ("no-such-process", "process-changed"):  # ended since the listing: nothing to stop
            print(f"{what} already gone")
        else:
            print(f"gpukillctl: {what} not stopped: {shown(e.error or e.result)}", file=sys.stderr)
            codes.append(_ENTRY_EXIT.get(e.result, EXIT_REFUSED))
    r = reply.reclaim
    line = f"{shown(reply.selection)}: {reclaim_text(r)}"
    if r.verdict in ("held", "stuck", "alive"):
        print(f"gpukillctl: {line}", file=sys.stderr)
        codes.append({"held": EXIT_MEMORY_HELD}.get(r.verdict, EXIT_STILL_ALIVE))
    else:
        print(line)
    return batch_exit(codes)
