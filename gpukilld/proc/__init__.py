"""What the kernel says about one process, read without vendor libraries: /proc (procfs.py), what job or
container a process belongs to (attribution.py) and the pidfd exit watch (exit_watch.py). Below the
backends, which read /proc for the processes on their devices: it imports only gpukill, the daemon's base
(model, config, journal, names, audit_settings) and itself.
"""
