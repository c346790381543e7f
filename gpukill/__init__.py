"""What the daemon and its clients share: code with no bus, no vendor library and no import of gpukilld.

- errors: the failures the daemon reports, each with its D-Bus error name (clients map the names back)
- policy: the Guard policy language (the daemon loads it, `gpukillctl guard validate` checks it offline)
- procstat: /proc/PID/stat, parsed the one way
- regex: RE2 for patterns from callers and policies (linear time)
- text: escaping of text that processes control, before a terminal, a message or an e-mail shows it
- units: sizes and numbers as the policy language and the tables write them

gpukillctl may import this package and nothing else of the daemon (tests/test_imports.py checks it).
"""
