"""How a sample is taken: the sampler (sampler.py) merges the backends' readings and /proc into an
immutable Snapshot, woken by the kernel's process events (proc_events.py, the proc connector). It imports
the base, proc/ and backends/; nothing above it (access, rogue, acts, guard, bus).
"""
