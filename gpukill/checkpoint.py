"""A workload's checkpoint declaration: the signal on which it saves its work, and the time it needs to.

A process declares it in its environment, `GPUKILL_CHECKPOINT=SIG:DURATION[:each]` (e.g. `USR1:120s`); a policy
rule declares it for its victims with `checkpoint: {signal: USR1, wait: 2m, each: false}`. Before the SIGTERM of a
kill that asks for it, gpukilld sends that signal and waits up to the declared time (capped by the policy's
`max_checkpoint_wait`) for the job to exit by itself. A process that declared nothing gets no new signal.

SIG is a signal name with or without "SIG" (USR1, SIGUSR2, INT, HUP, ...): never KILL or STOP, which no process
can catch, nor a real-time signal. `each`: every declaring member of a tree or unit gets the signal; without it
the leader alone does (children inherit the environment, so a trainer's workers declare too).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from .units import DURATION_FORMS, MAX_DURATION_TEXT, format_duration, parse_duration

ENVIRONMENT_VARIABLE = "GPUKILL_CHECKPOINT"
FROM_ENVIRONMENT = "environment"
FROM_SLURM = "slurm"  # the source of a Slurm job's `#SBATCH --signal`
POLICY_PREFIX = "policy "  # the source of a rule's declaration: "policy FILE:LINE:COL"
EACH = "each"
DEFAULT_MAX_WAIT = 600.0  # the policy's max_checkpoint_wait when it says none
MAX_CHECKPOINT_WAIT = 3600.0  # the largest max_checkpoint_wait a policy may set: a kill's reply comes within it
MAX_DECLARATION = 64 + MAX_DURATION_TEXT  # characters of GPUKILL_CHECKPOINT read; a longer value is malformed
# Signals a process cannot catch, or that stop rather than ask: never a checkpoint signal.
_REFUSED = frozenset({signal.SIGKILL, signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
FORM = "SIG:DURATION[:each], e.g. USR1:120s"


class BadDeclaration(ValueError):
    """A declaration that cannot be followed; its message is one line."""


@dataclass(frozen=True, slots=True)
class Declaration:
    """What a workload asked for: the signal to send before TERM and how long to wait for its exit after it."""

    signal: int  # a signal number (signal.Signals)
    wait: float  # seconds, as declared (the policy's cap applies when it is used)
    each: bool = False  # every declaring member of a batch, not its leader alone
    source: str = FROM_ENVIRONMENT  # FROM_ENVIRONMENT, FROM_SLURM (its job's --signal) or "policy FILE:LINE:COL"

    @property
    def name(self) -> str:
        """The signal's name as people read it: "SIGUSR1"."""
        return signal_name(self.signal)

    def capped(self, cap: float) -> float:
        """The seconds to wait under the policy's max_checkpoint_wait."""
        return min(self.wait, cap)

    @property
    def text(self) -> str:
        """The declaration as written in the environment's form: "USR1:2min" (":each" added when set)."""
        return f"{self.name.removeprefix('SIG')}:{format_duration(self.wait)}{':each' if self.each else ''}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def parse_signal(value: object) -> int:
    """A signal number from its name (USR1, SIGUSR1, usr1); BadDeclaration for KILL, STOP and unknown names."""
    if not isinstance(value, str) or not value.strip():
        raise BadDeclaration(f"a checkpoint signal is a name such as USR1, not {value!r:.40}")
    name = value.strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        number = signal.Signals[name]
    except KeyError:
        raise BadDeclaration(f"unknown signal {value.strip()[:20]!r} (write e.g. USR1, USR2, INT, HUP, TERM)") from None
    if number in _REFUSED or name.startswith("SIGRT"):
        raise BadDeclaration(f"{name} cannot be a checkpoint signal: a process cannot save on it")
    return int(number)


def parse_wait(value: object) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as e:
        raise BadDeclaration(f"the checkpoint wait: {e}") from None
    if seconds <= 0:
        raise BadDeclaration(f"the checkpoint wait must be more than 0s (write e.g. {DURATION_FORMS})")
    return seconds


def parse_declaration(text: str, source: str = FROM_ENVIRONMENT) -> Declaration:
    """GPUKILL_CHECKPOINT's value, SIG:DURATION[:each]; BadDeclaration (one line) when malformed."""
    if len(text) > MAX_DECLARATION:
        raise BadDeclaration(f"{ENVIRONMENT_VARIABLE} is longer than {MAX_DECLARATION} characters")
    parts = text.strip().split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2].strip().lower() != EACH):
        raise BadDeclaration(f"{ENVIRONMENT_VARIABLE}={text[:40]!r} is not {FORM}")
    return Declaration(parse_signal(parts[0]), parse_wait(parts[1].strip()), len(parts) == 3, source)


def from_environ(raw: bytes) -> Declaration | BadDeclaration | None:
    """The declaration in a process's environment (/proc/PID/environ: NUL-separated, read bounded): None when
    it declares none, the error when its value is malformed."""
    key = ENVIRONMENT_VARIABLE.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(key):
            try:
                return parse_declaration(item[len(key) :].decode("utf-8", "replace"))
            except BadDeclaration as e:
                return e
    return None
