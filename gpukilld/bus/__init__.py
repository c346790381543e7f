"""The D-Bus side: the door every call comes through (door.py), the writer that sends replies and signals
(writer.py), the wire form of records (wire.py), org.gpukill1.Manager (manager.py) and org.gpukill1.Guard
(guard.py). The interface names are the base's (gpukilld/names.py), since the bouncer's table names methods
by them. It may import every folder below it; only main.py imports it.
"""
