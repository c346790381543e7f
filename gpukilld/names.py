"""gpukilld's names on the bus, as dbus/org.gpukill1.xml and dbus/org.gpukill1.conf give them.

A module of their own because both sides of the gate use them: the bouncer's table names methods by these
interfaces, and the bus layer (gpukilld/bus/door.py), which consults that table, serves them.
"""

BUS_NAME = "org.gpukill1"
OBJECT_PATH = "/org/gpukill1"
MANAGER_INTERFACE = "org.gpukill1.Manager"
GUARD_INTERFACE = "org.gpukill1.Guard"
INTERFACES = (MANAGER_INTERFACE, GUARD_INTERFACE)
