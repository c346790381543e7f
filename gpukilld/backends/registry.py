"""Which backends a daemon runs: names from the configuration mapped to constructors.

`backends = auto` (the default) means the simulated backend when a device file is configured, else every
real backend, each of which reports itself unavailable (with the reason) where its hardware or library is
missing. Each backend module adds one line to FACTORIES.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import Config
from ..errors import ConfigError
from . import Backend
from .simulated import SimulatedBackend

FACTORIES: dict[str, Callable[[Config], Backend]] = {
    "simulated": lambda c: SimulatedBackend(c.simulate or "", _procfs(c)),
    "nvidia": lambda c: _nvidia(c),
    "drm": lambda c: _drm(c),
}
REAL_BACKENDS: tuple[str, ...] = ("nvidia", "drm")  # in this order under `auto`; each vendor backend appends its name


def _nvidia(config: Config) -> Backend:
    from .nvidia import NvidiaBackend  # imports pynvml only when configured

    return NvidiaBackend(_procfs(config))


def _drm(config: Config) -> Backend:
    from .drm import DrmBackend  # AMD, Intel, Arm and Apple GPUs through sysfs, DRM fdinfo and KFD

    return DrmBackend(config.sys_root, config.proc_root, config.debugfs_root)


def _procfs(config: Config):
    from ..procfs import ProcFS

    return ProcFS(config.proc_root)


def backend_names(config: Config) -> tuple[str, ...]:
    if config.backends is not None:
        return config.backends
    return ("simulated",) if config.simulate else REAL_BACKENDS


def build_backends(config: Config) -> list[Backend]:
    names = backend_names(config)
    for name in names:
        if name not in FACTORIES:
            raise ConfigError(f"unknown backend {name!r} (known: {', '.join(sorted(FACTORIES))})")
    if "simulated" in names and not config.simulate:
        raise ConfigError("the simulated backend needs a device file: set simulate = FILE or --simulate FILE")
    return [FACTORIES[name](config) for name in names]
