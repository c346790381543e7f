"""Vendor backends behind one small interface; nothing above this package knows vendors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..model import BackendStatus, DeviceReading, ProcessUsage


@dataclass(slots=True)
class BackendSample:
    devices: list[DeviceReading] = field(default_factory=list)
    processes: list[ProcessUsage] = field(default_factory=list)


class Backend(ABC):
    name: str

    @abstractmethod
    def status(self) -> BackendStatus:
        """Whether the backend works on this host and, if not, why (shown by `gpukillctl status`)."""

    @abstractmethod
    def sample(self) -> BackendSample:
        """Read devices and the processes on them. Runs in the sampler thread; may block."""

    def check_reset(self, device_id: str) -> None:  # noqa: B027 - optional hook
        """Raise NotSupported when this device cannot be reset, before anything is killed to clear it."""

    @abstractmethod
    def reset(self, device_id: str) -> str:
        """Reset one device; return a one-line result. Raise NotSupported or ResetFailed (device unchanged)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
