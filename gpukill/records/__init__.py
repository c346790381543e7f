"""The records gpukilld hands out, each declared once: its fields, their D-Bus signatures and what they mean.

Everything else is derived from these declarations: the daemon's a{sv} marshalling (gpukilld/bus/wire.py), the
client's typed records (gpukillctl/client/dbus.py builds these same classes from what it receives), `list --json`
and the JSON the policy sandbox exchanges with its child (`to_plain` / `from_plain` in base). A device field is
one edit here plus its documentation (the JSON section of docs/using.md, dbus/org.gpukill1.xml): the daemon
holds these Devices, and its backends' DeviceReading is derived from them. The daemon's GpuProcess is this Process with
the system unit added; a process field is one edit here plus its documentation and where it is read (ProcInfo
from /proc, or a backend's ProcessUsage); tests/test_records.py checks they agree.

On the bus a record is an a{sv}. A value nobody could read is None and left out, never sent as 0; a field
declared `omit_empty` is also left out when empty ("", (), False): shared_usage is there only when true.
A client fills what was left out with the field's default. The plain (JSON) form has every field, null
where left out (false for a flag); a map keyed by name (memory_regions, notifications) keeps the bus's
shape: its entries carry only the values that are known.

Types: "q", "u", "t" are int; "d" float; "b" bool; "s" str; "as"/"au"/"aq" tuples; "aa{sv}" a tuple of records;
"a{sv}" one record, or with `key` a tuple of records keyed by that field (the entries as a{sv} variants);
"a{sa{sT}}" likewise, each entry an a{sT} of the record's values.

Split by who needs them, each imported from the module that declares it: a frozen, slotted dataclass generates
and compiles its methods when its class statement runs (~0.35 ms each), and a one-shot `gpukillctl list` needs 3
of the 24 records. The modules: base (wire() and the plain form), manager (the listings': devices, processes,
memory regions), status (the Manager's others: a reset's reply, backends, sampling), audit, guard, signals, usage
and reclaim (a kill's answer: the memory back or who holds it). This package itself imports none of them.
"""
