"""Where a process's checkpoint declaration comes from (gpukill.checkpoint): the first source found wins.

1. the process's own environment, GPUKILL_CHECKPOINT (ProcFS.checkpoint);
2. its Slurm job's `--signal=B:SIG@SECS`, for a process of a job (read from the job: the seam below);
3. the policy rule's `checkpoint:` (applied by the kill path, gpukilld/acts/checkpoint.py, to a process that
   declares nothing itself).

Reads /proc: call it in a worker thread, never on the loop.
"""

from __future__ import annotations

from gpukill.checkpoint import BadDeclaration, Declaration

from .procfs import ProcFS


def declared(procfs: ProcFS, pid: int, slurm_job: str | None) -> Declaration | BadDeclaration | None:
    """What the process declares itself: its environment's declaration, else its Slurm job's (a job's
    `--signal` becomes Declaration(signal, seconds, source="slurm") here); None when neither says any,
    the error when its own declaration is malformed (then it gets no signal at all)."""
    own = procfs.checkpoint(pid)
    if own is not None or slurm_job is None:
        return own
    return None  # the Slurm job's --signal=B:SIG@SECS is read here: slurm_checkpoint(slurm_job)
