"""HTTP plumbing shared by the two HTTP servers, `gpukillctl serve` and `gpukillctl exporter`: the gate every
request passes (gate.py), uvicorn's connection protocol with deadlines (protocol.py), and what both need
before they listen (listen.py). It imports gpukill, itself, and client/ only for the exit codes; never a
front end.
"""
