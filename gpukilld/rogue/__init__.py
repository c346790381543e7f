"""The rogue-activity audit: each process's findings and score (score.py), the watch that gathers its
evidence each round (watch.py), the pool connections a process made (sockets.py over sock_diag.py), an
executable replaced on disk (exe_replaced.py) and how a process is recognised as running an allowed
executable (trusted_exe.py). Its settings are the base's (gpukilld/audit_settings.py), since the
configuration reads them. It imports the folders below it up to access/; never acts/, guard/ or bus/.
"""
