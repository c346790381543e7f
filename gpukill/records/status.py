"""Manager's records that the listings do not need: a reset's reply, a backend's status, how the daemon
samples (the listings' own are in manager.py).
Imported by the daemon and by the clients that reset or show the daemon's status, on first use."""

from __future__ import annotations

from dataclasses import dataclass

from .base import wire


@dataclass(frozen=True, slots=True)
class ResetReply:
    """What ResetDevice returns."""

    device: int = wire("u", "the device's global index")
    device_id: str = wire("s", "the device's id")
    message: str = wire("s", "the backend's text")
    killed: tuple[int, ...] = wire("au", "PIDs killed first (reset with force)", ())


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """One entry of the Backends property, a (sbs) struct."""

    name: str = wire("s", "the backend's name")
    available: bool = wire("b", "whether it reads devices")
    detail: str = wire("s", "why it is unavailable, or a one-line summary (driver version, device count)")


SAMPLING_EVENTS = "events"  # the kernel's proc connector tells exec, renames and uid changes as they happen
SAMPLING_POLLING = "polling"  # processes are re-read in rotation: what they become is seen up to ~90 s late


@dataclass(frozen=True, slots=True)
class SamplingStatus:
    """The Sampling property: how the daemon learns what its processes become (gpukilld/sampling/proc_events.py)."""

    mode: str = wire("s", '"events" (the kernel\'s proc connector) or "polling" (its fallback)', "")
    detail: str = wire("s", "with polling, why the connector is unavailable; with events, what the kernel sends", "")
    events: int = wire("t", "proc connector events read since the daemon started", 0)
    overruns: int = wire("t", "samples that re-read every process: events were lost or over the per-sample cap", 0)
