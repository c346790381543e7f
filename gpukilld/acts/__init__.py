"""What the daemon does to processes and devices: a kill through a pidfd after checking pid and start time
(killer.py), and kills and resets as callers and Guard ask for them, checked and audited (actions.py). It
imports the folders below it up to rogue/; never guard/ or bus/.
"""
