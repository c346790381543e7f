"""Standard modules the commands' start imports but a one-shot command never uses, imported on first use instead.

`dataclasses` imports two modules at its top for calls a one-shot command never makes: `inspect` (with ast, dis,
tokenize, linecache: ~5.5 ms, an eighth of `gpukillctl list --json`) for `inspect.signature`, called only to
write a docstring for a dataclass declared without one (each of ours has one: a record without one would load
it at its class statement, and the list test below would say so), and `copy` (with weakref: ~0.8 ms) for the
deep copies of asdict() and astuple(). A DeferredModule stands in sys.modules for such a module until anything
asks it for a name: it then imports the real module, which takes its place in sys.modules, and takes a copy of
its names, so that whoever imported the stand-in (dataclasses, at its top) reads the real module's from then
on. Nothing else changes: `import inspect` still works everywhere, and the first use pays what the import would
have paid. tests/test_cli_start.py checks that `list` leaves both unloaded and that they work through the
stand-in afterwards.

For the commands alone (gpukillctl/cli/__init__.py puts the stand-ins in place): never the daemon, never a
library user's process, and never over a module already imported.
"""

from __future__ import annotations

import sys
import types
from typing import Any

# What the commands' start defers: top-level modules that what the commands import imports, and that nothing on
# the one-shot path uses (tests/test_cli_start.py checks that `list` leaves them unloaded).
DEFERRED = ("inspect", "copy")


class DeferredModule(types.ModuleType):
    """The stand-in for a module not imported yet (its __spec__ is None, as ModuleType makes it, so an `import`
    statement takes it as it is without asking it anything)."""

    def __getattr__(self, attr: str) -> Any:  # only for a name not in this module's dict: before the first load
        return getattr(self._real(), attr)

    def __dir__(self) -> list[str]:
        return dir(self._real())

    def _real(self) -> types.ModuleType:
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]  # so that the import below finds and runs the real one
        # imports of one module are serialized by the import system's lock: a second thread here waits for the
        # first's import and gets the same module
        real = __import__(name)
        if self.__dict__.get("__spec__") is None:  # the first time: from now on this stand-in has its names
            self.__dict__.update(real.__dict__)
        return real


def defer(*names: str) -> None:
    """Put a stand-in in sys.modules for each module named that nothing has imported yet."""
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = DeferredModule(name)
