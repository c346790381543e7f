"""Where a process's checkpoint declaration comes from (gpukill.checkpoint): the first source found wins.

1. the process's own environment, GPUKILL_CHECKPOINT (ProcFS.checkpoint);
2. its Slurm job's `#SBATCH --signal=B:SIG@SECS`, for a process of a job of its own owner (read through Slurm's
   commands by gpukilld/acts/slurm.py, on the loop: Checkpoints.job_signal);
3. the policy rule's `checkpoint:` (applied by the kill path, gpukilld/acts/checkpoint.py, to a process that
   declares nothing itself).

Reads /proc: call it in a worker thread, never on the loop.
"""

from __future__ import annotations

from gpukill.checkpoint import BadDeclaration, Declaration

from .procfs import ProcFS


def declared(procfs: ProcFS, pid: int) -> Declaration | BadDeclaration | None:
    """What the process declares in its own environment (GPUKILL_CHECKPOINT): None when it says nothing, the
    error when its declaration is malformed (then it gets no signal at all, whatever its job or rule says)."""
    return procfs.checkpoint(pid)
