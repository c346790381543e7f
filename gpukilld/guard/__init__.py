"""Guard Mode: declarative policies the daemon enforces on its own snapshots.

gpukill/policy/ parses and validates policy files (no daemon or D-Bus imports: gpukillctl uses it offline),
conditions.py turns the snapshot into subjects and compiles conditions, engine.py is the evaluation and
duration / grace / cooldown state machine (pure, clock injected), runner.py carries its decisions out through
the daemon's kill path, notify.py delivers notifications off the enforcement path, state.py persists what must
survive a restart, sandbox.py evaluates a client's policy in a confined child. org.gpukill1.Guard on the bus
is gpukilld/bus/guard.py. It imports the folders below it up to acts/; never bus/.
"""
