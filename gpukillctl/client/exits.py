"""gpukillctl's exit statuses: one per kind of failure, and which daemon error ends in which."""

from __future__ import annotations

from gpukill import errors

from .api import ClientError, DaemonUnavailable

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_DENIED = 4
EXIT_NOT_FOUND = 5
EXIT_CHANGED = 6
EXIT_REFUSED = 7
EXIT_BUSY = 8
EXIT_NOT_SUPPORTED = 9
EXIT_STILL_ALIVE = 10
EXIT_RESET_FAILED = 11
EXIT_INVALID_POLICY = 12
EXIT_BUSY_TRY_AGAIN = 13
EXIT_MEMORY_HELD = 14  # the process exited, but related processes still hold its GPU's memory
EXIT_NO_SUCH_NAME = 15  # a selection names a user, group, unit or GPU that does not exist: a typo, not "none"

# By the shared error class the client's exception is (client.ERRORS): the D-Bus names are spelled there.
EXIT_FOR_ERROR: dict[type[Exception], int] = {
    DaemonUnavailable: EXIT_UNAVAILABLE,
    errors.AccessDenied: EXIT_DENIED,
    errors.NoSuchProcess: EXIT_NOT_FOUND,
    errors.NoSuchDevice: EXIT_NOT_FOUND,
    errors.ProcessChanged: EXIT_CHANGED,
    errors.Protected: EXIT_REFUSED,
    errors.NotAGpuProcess: EXIT_REFUSED,
    errors.DeviceBusy: EXIT_BUSY,
    errors.NotSupported: EXIT_NOT_SUPPORTED,
    errors.ResetFailed: EXIT_RESET_FAILED,
    errors.InvalidPolicy: EXIT_INVALID_POLICY,
    errors.InvalidArgs: EXIT_USAGE,
    errors.TooBusy: EXIT_BUSY_TRY_AGAIN,
}


def exit_code(e: ClientError) -> int:
    return next((code for cls, code in EXIT_FOR_ERROR.items() if isinstance(e, cls)), EXIT_FAILURE)


EXIT_CODES_HELP = """\
exit status:
  0   success
  1   other failure
  2   usage error or invalid arguments
  3   gpukilld or the system bus is not reachable
  4   access denied (polkit said no)
  5   no such process or GPU
  6   the PID now belongs to another process (list again)
  7   refused: protected process (PID 1, kernel thread, gpukilld) or not a GPU process
  8   GPU busy: processes still use it (reset --force kills them first)
  9   not supported on this GPU
  10  the process is still alive after the grace period (kill --force sends SIGKILL), or after SIGKILL
      (stuck in the kernel: the line says where, and which `gpukillctl reset N` frees the GPU)
  11  GPU reset failed; the device was left as it was
  12  the guard policy is invalid (each error as FILE:LINE:COL: message; the policy in force stays)
  13  too busy: a limit per user was reached (authorizations waiting for polkit, a policy test running);
      nothing was done, try again
  14  the process exited, but its GPU memory is still held (by its orphaned workers, its unit's or
      container's other processes: named on the line); kill --tree/--unit/--container reclaims a workload
  15  no such user, group, unit or GPU: a selection names one that does not exist (a user or group this
      host does not know, a unit systemd has no file or cgroup of, a GPU not listed); one that exists but
      has no GPU processes is exit status 0, with a line on stderr saying so

JSON (list --json) is stable: {"format": 1, "devices": [...], "processes": [...]}; every key is always present,
null where the daemon cannot read a value.

manual pages:
  man gpukillctl        commands, options, the JSON keys
  man gpukill-policy    Guard Mode policies (guard load, test, validate)"""


def batch_exit(codes: list[int]) -> int:
    """The exit status of a batch of kills (kill --job, --tree, --unit, --container): the first failure's, a
    process not stopped before memory merely still held (EXIT_MEMORY_HELD), else 0."""
    failed = [c for c in codes if c != EXIT_OK]
    return next((c for c in failed if c != EXIT_MEMORY_HELD), failed[0] if failed else EXIT_OK)
