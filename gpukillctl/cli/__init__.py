"""gpukillctl's commands and `gpukill`: the parser and dispatcher (main.py), gpu-kill's flags translated
(compat.py), `guard` and `audit` (guard.py, audit.py), and kills by Slurm job (job_kill.py). It stands on
client/; main.py alone also imports the other front ends, and only their entry points (register, cmd_*),
to dispatch to them. No front end imports cli/.
"""
