"""Which backends a daemon runs: names from the configuration mapped to constructors.

`backends = auto` (the default) means the simulated backend when a device file is configured, else every
real backend, each of which reports itself unavailable (with the reason) where its hardware or library is
missing. Each backend module adds one line to FACTORIES and one to SETTINGS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpukill.errors import ConfigError

from ..config import Config, backends_problem
from . import Backend
from .simulated import SimulatedBackend

FACTORIES: dict[str, Callable[[Config], Backend]] = {
    "simulated": lambda c: SimulatedBackend(c.simulate or "", _procfs(c)),
    "nvidia": lambda c: _nvidia(c),
    "drm": lambda c: _drm(c),
}
REAL_BACKENDS: tuple[str, ...] = ("nvidia", "drm")  # in this order under `auto`; each vendor backend appends its name
# The settings each factory reads. A reload whose settings for a backend are unchanged keeps the running backend
# (see build_backends). A backend not listed here is rebuilt on any change to the configuration.
SETTINGS: dict[str, Callable[[Config], tuple]] = {
    "simulated": lambda c: (c.simulate, c.proc_root),
    "nvidia": lambda c: (c.proc_root,),
    "drm": lambda c: (c.sys_root, c.proc_root, c.debugfs_root, c.sys_uid_max),
}


def _nvidia(config: Config) -> Backend:
    from .nvidia import NvidiaBackend  # imports pynvml only when configured

    return NvidiaBackend(_procfs(config))


def _drm(config: Config) -> Backend:
    from .drm import DrmBackend  # AMD, Intel, Arm and Apple GPUs through sysfs, DRM fdinfo and KFD

    return DrmBackend(
        config.sys_root, config.proc_root, config.debugfs_root, system_uid_max=config.sys_uid_max
    )  # login.defs as the configuration read it


def _procfs(config: Config):
    from ..proc.procfs import ProcFS

    return ProcFS(config.proc_root)


def backend_names(config: Config) -> tuple[str, ...]:
    if config.backends is not None:
        return config.backends
    return ("simulated",) if config.simulate else REAL_BACKENDS


def backend_specs(config: Config) -> list[tuple[str, tuple]]:
    """Each configured backend as (name, the settings it is built from): equal specs, interchangeable backends."""
    return [(name, SETTINGS.get(name, lambda c: (c,))(config)) for name in backend_names(config)]


def build_backends(config: Config, previous: tuple[Config, Sequence[Backend]] | None = None) -> list[Backend]:
    """The configured backends. `previous` is the configuration in force and the backends built from it: one
    of those whose name and settings are unchanged is kept rather than built again.

    Keeping matters on reload: a rebuilt backend forgets what only it knew (an Xid reported on a GPU, the
    utilization history that DRM percentages are computed from), so a reload made to pick up guard.d or
    [notify] must not touch the GPUs. The caller closes the running backends that are not returned."""
    names = backend_names(config)
    for name in names:
        if name not in FACTORIES:
            raise ConfigError(f"unknown backend {name!r} (known: {', '.join(sorted(FACTORIES))})")
    if (why := backends_problem(names)) is not None:  # for any Config, however made (load_config adds FILE:LINE)
        raise ConfigError(why)
    if "simulated" in names and not config.simulate:
        raise ConfigError("the simulated backend needs a device file: set simulate = FILE or --simulate FILE")
    keep = dict(zip(backend_specs(previous[0]), previous[1], strict=True)) if previous else {}
    backends = []
    for spec in backend_specs(config):
        backend = keep.pop(spec, None)  # pop: a backend is kept once, never listed twice
        backends.append(backend if backend is not None else FACTORIES[spec[0]](config))
    return backends
