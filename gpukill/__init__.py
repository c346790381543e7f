"""What the daemon and its clients share: code with no bus, no vendor library and no import of gpukilld.

- condition_types: each Guard condition type declared once, which the parser and the engine work from
- errors: the failures the daemon reports, each with its D-Bus error name (clients map the names back)
- limits: bounds the daemon enforces and its clients check too (the kill grace)
- outcome: how a kill ended (Outcome, with its text) and who asked for it (the initiator), one word each
- policy: the Guard policy language (the daemon loads it, `gpukillctl guard validate` checks it offline)
- procstat: /proc/PID/stat, parsed the one way
- records: the records on the bus (devices, processes, guard status, ...), each field declared once with its
  D-Bus signature and meaning; their plain (JSON) form
- regex: RE2 for patterns from callers and policies (linear time)
- rules: what a Guard policy is, as records (rules, conditions, exemptions, settings), without YAML
- text: escaping of text that processes control, before a terminal, a message or an e-mail shows it
- units: sizes and numbers as the policy language and the tables write them

gpukillctl may import this package and nothing else of the daemon (tests/test_imports.py checks it).
"""
