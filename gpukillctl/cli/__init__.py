"""gpukillctl's commands and `gpukill`: the parser and dispatcher (main.py), gpu-kill's flags translated
(compat.py), `guard` and `audit` (guard.py, audit.py), and `kill`'s answer (kill_answer.py). It stands on
client/; main.py alone also imports the other front ends, and only their entry points (register, cmd_*),
to dispatch to them. No front end imports cli/.
"""

from .deferred import DEFERRED, defer

# Here, before any command's module imports dataclasses: every way of running a command (the gpukillctl and
# gpukill entry points, `python -m gpukillctl`, the packages' wrappers) comes through this package first, and
# nothing else does (deferred.py says why, and what).
defer(*DEFERRED)
