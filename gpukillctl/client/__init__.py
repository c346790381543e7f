"""The client library every front end stands on: the typed API (api.py, written once), its two transports on
the system bus (dbus.py on asyncio and dbus-fast, blocking.py on jeepney for one-shot commands), -H over ssh
(remote.py), the polkit agent, the exit codes and how records are written for people (format.py). It imports
only gpukill and itself: never a front end, never cli/, never gpukilld.
"""
