"""Guard Mode: declarative policies the daemon enforces on its own snapshots.

policy.py parses and validates policy files (no daemon or D-Bus imports: gpukillctl uses it offline),
conditions.py compiles conditions into predicates, engine.py is the evaluation and duration / grace /
cooldown state machine (pure, clock injected), notify.py delivers notifications off the enforcement path,
state.py persists what must survive a restart, service.py is org.gpukill1.Guard on the bus.
"""
