"""The driver seam of suspend and resume: NVIDIA's `cuda-checkpoint` utility, run as a child process.

The driver's checkpoint API (cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState, driver 550+) is reached
through the utility rather than libcuda loaded into the daemon: a driver call that hangs then costs one child,
killed at its timeout and reported, never a thread of the daemon that cannot be cancelled, nor the main loop.
Its command line (NVIDIA/cuda-checkpoint): `--get-state --pid P` prints running, locked, checkpointed or failed;
`--action lock|checkpoint|restore|unlock --pid P [--timeout MS]` exits 0 on success, else non-zero with a message
on stderr. What each child prints is read up to MAX_OUTPUT bytes; the rest is discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from gpukill.errors import GpukillError

from .children import read_bounded

SEARCH_PATH = ("/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin")
MAX_OUTPUT = 4096
CALL_TIMEOUT = 120.0  # seconds one call may take, and for a checkpoint or restore SECONDS_PER_GIB more per GiB moved
SECONDS_PER_GIB = 4.0  # a copy well under 1 GiB/s is a hang, not a slow bus (PCIe moves 10-50 GiB/s)
LOCK_TIMEOUT_MS = 10_000  # what `lock` waits for the process's submitted work before it fails

# The driver's states of a process (CU_PROCESS_STATE_*), as --get-state prints them.
RUNNING = "running"
LOCKED = "locked"
CHECKPOINTED = "checkpointed"
FAILED = "failed"


class CheckpointError(GpukillError):
    """A cuda-checkpoint call failed, timed out or could not run; the message is one line."""

    result = "checkpoint-failed"


def find_cuda_checkpoint(configured: str | None) -> str | None:
    """The utility: gpukilld.conf's cuda_checkpoint where given (None when it is not an executable there), else
    the first `cuda-checkpoint` in SEARCH_PATH."""
    candidates = [configured] if configured else [os.path.join(d, "cuda-checkpoint") for d in SEARCH_PATH]
    return next((p for p in candidates if os.path.isfile(p) and os.access(p, os.X_OK)), None)


def _line(data: bytes) -> str:
    return " ".join(data.decode("utf-8", "replace").split())[:512]


class CudaCheckpoint:
    """Runs the utility at `path`, one child per call, each with a timeout."""

    def __init__(self, path: str, timeout: float = CALL_TIMEOUT) -> None:
        self.path = path
        self.timeout = timeout

    async def _run(self, *args: str, moved: int = 0) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of one call; CheckpointError when it cannot start or outlives the timeout
        (it is killed then, and waited for). moved: bytes the call copies, which give it more time."""
        timeout = self.timeout + SECONDS_PER_GIB * moved / (1 << 30)
        try:
            child = await asyncio.create_subprocess_exec(
                self.path,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise CheckpointError(f"cannot run {self.path}: {e.strerror or e}") from None
        try:
            out, err, _ = await asyncio.wait_for(
                asyncio.gather(
                    read_bounded(child.stdout, MAX_OUTPUT), read_bounded(child.stderr, MAX_OUTPUT), child.wait()
                ),
                timeout,
            )
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()
            raise CheckpointError(f"cuda-checkpoint {' '.join(args)} did not finish within {timeout:g}s") from None
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            raise
        return child.returncode or 0, _line(out), _line(err)

    async def state(self, pid: int) -> str:
        """The driver's state of the process: running, locked, checkpointed or failed."""
        code, out, err = await self._run("--get-state", "--pid", str(pid))
        if code != 0:
            raise CheckpointError(f"cuda-checkpoint --get-state failed for PID {pid}: {err or out or f'exit {code}'}")
        return out.split()[0] if out else ""

    async def act(self, action: str, pid: int, lock_timeout_ms: int = LOCK_TIMEOUT_MS, moved: int = 0) -> None:
        """One step (lock, checkpoint, restore, unlock); CheckpointError with the utility's message if it fails.
        moved: the bytes a checkpoint or restore copies (its timeout grows with them)."""
        args = ["--action", action, "--pid", str(pid)]
        if action == "lock":
            args += ["--timeout", str(lock_timeout_ms)]
        code, out, err = await self._run(*args, moved=moved)
        if code != 0:
            raise CheckpointError(f"{action} of PID {pid} failed: {err or out or f'exit {code}'}")
