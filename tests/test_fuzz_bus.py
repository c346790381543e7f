"""Property-based fuzz of every org.gpukill1 method and property over a real bus.

Every method of both interfaces (read from dbus/org.gpukill1.xml), every property through
org.freedesktop.DBus.Properties (Get, GetAll, Set), Introspect, Peer, ObjectManager, unknown members, wrong
interfaces, no interface and other object paths, with arbitrary arguments: the right signature with arbitrary
values (a{sv} arguments with arbitrary keys and variants of arbitrary types), near misses (an argument more or
less) and arbitrary signatures with bodies that fit them. Each identity (an unprivileged user, root, a polkit
admin) is one long-lived client process (tests/clients/fuzz_client.py) fed JSON lines, so an example costs one bus round
trip.

Properties checked for every call: a reply comes (never a timeout, never NoReply, never a dropped connection);
an error's name is one of ALLOWED_ERRORS (gpukilld's documented errors and the standard ones that dbus-fast,
the door handler and dbus-daemon answer with; each is explained there) and its text is never a Python
traceback; a successful call to one of our methods replies with the out signature in the XML; the unprivileged
user never succeeds in a privileged method. Every CHECK_EVERY calls and after each run: gpukilld is the same
process, alive, owns org.gpukill1 on the bus (GetConnectionUnixProcessID says its PID) and answers
ListProcesses({}); a bystander process (not on a GPU) that KillProcess is aimed at is still alive. After each
run: gpukilld's log holds no traceback at all.

Safety: the daemon runs in a private testbed on simulated GPUs and only sees processes carrying the testbed's
scope, so the one victim started here is the only GPU process (it may be killed: that is fine). KillProcess is
never sent with the exact (pid, start_time) of a process outside the testbed's targets (assume() below).
Guard state changes (LoadPolicy, Enable, SetDryRun) only touch this testbed's state directory.

A failure names the offending call (hypothesis shrinks it) and quotes the end of the daemon's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.marks import needs_root
from helpers.testbed import PYTHON, REPO, Testbed, User, start_time_of
from hypothesis import HealthCheck, assume, example, given, note, seed, settings
from hypothesis import strategies as st

pytestmark = needs_root

BUS_NAME, OBJECT_PATH = "org.gpukill1", "/org/gpukill1"
MANAGER, GUARD = "org.gpukill1.Manager", "org.gpukill1.Guard"
PROPS, INTROSPECTABLE, PEER = (
    "org.freedesktop.DBus.Properties",
    "org.freedesktop.DBus.Introspectable",
    "org.freedesktop.DBus.Peer",
)
OBJECT_MANAGER = "org.freedesktop.DBus.ObjectManager"
FDO = "org.freedesktop.DBus.Error."

EXAMPLES = {"other": 600, "root": 600, "admin": 200}  # per identity: about 20 s in all (root's resets wait
# for a fresh sample), the module about 25 s
SCALE = float(os.environ.get("GPUKILL_FUZZ_SCALE", "1"))  # e.g. 20 for a long run by hand
SEED_OFFSET = int(os.environ.get("GPUKILL_FUZZ_SEED", "0"))  # other inputs for a run by hand; the suite uses 0
SEEDS = {"other": 9001, "root": 9002, "admin": 9003}  # fixed: the suite is repeatable
CHECK_EVERY = 25  # calls between full daemon checks (bus ownership, PID, ListProcesses)
CALL_TIMEOUT = 45.0  # the client gives up at 30 s and says so; this is for a client that hangs itself


# -- the contract ----------------------------------------------------------------------------------------------


def _contract() -> tuple[dict[tuple[str, str], tuple[str, str]], dict[tuple[str, str], str]]:
    """(iface, method) -> (in signature, out signature) and (iface, property) -> type, from the XML."""
    root = ET.parse(REPO / "dbus" / "org.gpukill1.xml").getroot()
    methods, props = {}, {}
    for iface in root.findall("interface"):
        name = iface.get("name")
        for m in iface.findall("method"):
            args = m.findall("arg")
            ins = "".join(a.get("type") for a in args if a.get("direction", "in") == "in")
            outs = "".join(a.get("type") for a in args if a.get("direction") == "out")
            methods[(name, m.get("name"))] = (ins, outs)
        for p in iface.findall("property"):
            props[(name, p.get("name"))] = p.get("type")
    return methods, props


METHODS, PROPERTIES = _contract()
assert set(METHODS) == {
    (MANAGER, "ListDevices"),
    (MANAGER, "ListProcesses"),
    (MANAGER, "KillProcess"),
    (MANAGER, "ResetDevice"),
    (MANAGER, "ListProcessesCompact"),
    (MANAGER, "AuditRogue"),
    (GUARD, "Enable"),
    (GUARD, "Disable"),
    (GUARD, "SetDryRun"),
    (GUARD, "LoadPolicy"),
    (GUARD, "GetStatus"),
    (GUARD, "TestPolicies"),
    (GUARD, "ListPolicies"),
    (GUARD, "SetPolicy"),
    (GUARD, "RemovePolicy"),
    (GUARD, "ExportPolicies"),
    (GUARD, "ImportPolicies"),
    (MANAGER, "AuditRogueWith"),
    (MANAGER, "GetAuditSettings"),
    (MANAGER, "SetAuditSettings"),
    (MANAGER, "ExportAuditSettings"),
    (MANAGER, "ImportAuditSettings"),
    (MANAGER, "GetUsage"),
    (MANAGER, "KillProcessReport"),
    (MANAGER, "KillWorkload"),
    (GUARD, "Postpone"),
    (MANAGER, "SuspendWorkload"),
    (MANAGER, "ResumeWorkload"),
    (MANAGER, "ListSuspended"),
}, f"the XML's methods changed: update this fuzz ({sorted(METHODS)})"
MEMBER_IFACE = {member: iface for iface, member in METHODS}  # every member name is unique to one interface
assert len(MEMBER_IFACE) == len(METHODS)


def _privileged() -> set[str]:
    """Members that need a polkit action (the bouncer's table): an unprivileged user must never succeed."""
    from gpukilld.access.bouncer import METHOD_ACTIONS

    return {member for (_, member), action in METHOD_ACTIONS.items() if action}


PRIVILEGED = _privileged()


def _documented_errors() -> dict[str, str]:
    """gpukilld's own errors: every GpukillError subclass of gpukilld/errors.py by its dbus_name, the policy
    parser's InvalidPolicy, and the base class's org.gpukill1.Error.Failed (an unexpected failure the daemon
    caught and reported in one line: e.g. the policy sandbox failing, GetStatus failing)."""
    from gpukill import errors
    from gpukill.policy import PolicyError

    out: dict[str, str] = {}
    stack = [errors.GpukillError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__ == errors.__name__:
            out[cls.dbus_name] = f"gpukilld/errors.py: {cls.__name__}"
    assert PolicyError.dbus_name == "org.gpukill1.Error.InvalidPolicy"
    out[PolicyError.dbus_name] = "gpukill/policy/messages.py: PolicyError (LoadPolicy, TestPolicies)"
    out["org.gpukill1.Error.Failed"] = "gpukilld/errors.py: GpukillError, the base class"
    return out


# Standard errors, with where each comes from (dbus-fast 5.2: message_bus.py, _find_message_handler and
# _default_properties_handler; gpukilld/bus/door.py: Door; dbus-daemon: the bus policy of dbus/org.gpukill1.conf).
STANDARD_ERRORS = {
    FDO + "AccessDenied": "Door: a member of our interfaces (or, without an interface, a member) the bouncer's table "
    "does not "
    "map; errors.AccessDenied: polkit said no; dbus-daemon: the bus policy lets non-root callers send to "
    "org.gpukill1 only on the Manager, Guard, Introspectable, Properties and Peer interfaces; dbus-fast: "
    "Peer.GetMachineId, which it forwards to dbus-daemon, and dbus-daemon's bus policy refuses (the error "
    "name of that refusal is passed on)",
    FDO + "InvalidArgs": "errors.InvalidArgs: a bad option or filter key or value",
    FDO + "UnknownMethod": "dbus-fast: no handler for this interface, member AND signature (a real method with a wrong "
    "signature, Introspect/Ping/GetMachineId with arguments, an unknown Properties member or a Properties "
    "member with the wrong signature, anything at a path where nothing is exported)",
    FDO + "UnknownObject": "dbus-fast: Properties.Get/GetAll/Set at a path where nothing is exported",
    FDO + "UnknownInterface": "dbus-fast: Properties.Get/GetAll of an interface not exported at the path",
    FDO + "UnknownProperty": "dbus-fast: Properties.Get of a property the interface does not have (any property of a "
    "standard "
    "interface, every property of org.gpukill1.Guard)",
    FDO
    + "PropertyReadOnly": "Door: every Properties.Set at /org/gpukill1, whatever its interface, property or signature",
    FDO + "NotSupported": "dbus-fast: Properties.Get/GetAll with the empty interface name",
}
# Not allowed, on purpose: org.freedesktop.DBus.Error.Failed (no path of the daemon sends it with our objects;
# dbus-fast only uses it for a Peer.GetMachineId the bus cannot answer); InvalidSignature (dbus-fast's Set of a
# writable property with a variant of the wrong type: there are no writable properties, and the Door answers
# every Set first); com.dubstepdish.dbus.next.ServiceError / InternalError (dbus-fast's answer when a method or
# the door handler raised an unexpected Python exception: a daemon bug); NoReply, ServiceUnknown,
# NameHasNoOwner, Disconnected (the daemon is gone or did not answer).
ALLOWED_ERRORS = {**_documented_errors(), **STANDARD_ERRORS}


# -- strategies: D-Bus types and values in the client's wire JSON (see clients/fuzz_client.py) -----------------------

INT_RANGES = {
    "y": (0, 2**8 - 1),
    "n": (-(2**15), 2**15 - 1),
    "q": (0, 2**16 - 1),
    "i": (-(2**31), 2**31 - 1),
    "u": (0, 2**32 - 1),
    "x": (-(2**63), 2**63 - 1),
    "t": (0, 2**64 - 1),
}
BASIC = "ybnqiuxtdsog"  # every basic type but h (file descriptors need fd passing)
MAX_VARIANT_DEPTH = 3

basic_sigs = st.sampled_from(list(BASIC))


def _containers(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        inner.map(lambda s: "a" + s),
        st.tuples(basic_sigs, inner).map(lambda kv: "a{" + kv[0] + kv[1] + "}"),
        st.lists(inner, min_size=1, max_size=4).map(lambda xs: "(" + "".join(xs) + ")"),
    )


# One complete type. Nesting stays far under the protocol's limits (32 arrays, 32 structs, 64 in all).
single_sigs = st.one_of(
    st.sampled_from(["a{sv}", "v", "as", "au", "ay", "(uu)", "aa{sv}", "a{sa{sv}}", "av", "a{ss}", "(sbs)"]),
    st.recursive(basic_sigs | st.just("v"), _containers, max_leaves=6),
).filter(lambda s: len(s) <= 64)
body_sigs = st.lists(single_sigs, max_size=4).map("".join)

# Strings: never NUL and never a surrogate (D-Bus strings are valid UTF-8 without NUL; the bus disconnects a
# client that sends one), but every other character: controls, non-BMP, combining, bidi overrides.
CHARS = st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))
DEVICE_IDS = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "-1",
    "4294967296",
    "GPU-8f1c6a2e-0b7d-4c1e-9a55-3d2e7f10a001",
    "gpu-8f1c6a2e-0b7d-4c1e-9a55-3d2e7f10a002",
    "0000:18:00.0",
    "0000:2A:00.0",
    "0000:c1:00.0",
    "0000:03:00.0",
    "18:00.0",
    " 0",
    "0 ",
    "00",
]
# an alias bomb: nine levels of nine references (a parser that expands aliases visits 9**9 items)
BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)
POLICIES = [
    "",
    "rules: []\n",
    "{}",
    "[]",
    "null",
    "~",
    "---\n...\n",
    "%YAML 1.1\n---\nrules: []\n",
    "rules:\n  -\n",
    "rules:\n  - name: x\n    conditions:\n      - {type: process_name, operator: '==', value: fuzzvictim}\n"
    "    action: log\n",
    "rules:\n  - name: k\n    conditions:\n      - {type: gpu_memory, operator: '>', value: 0B}\n    action: kill\n",
    "rules:\n  - name: r\n    conditions:\n      - {type: process_name, operator: matches, value: '(a+)+$'}\n"
    "    action: notify\n",
    "dry_run: .nan\nmax_kills_per_cycle: 1e400\ncooldown: 99999999999999999999999d\n",
    "!!python/object/apply:os.system ['true']\n",
    "a: !!binary AAAA\n",
    "a: *undefined\n",
    BOMB,
    "[" * 500 + "]" * 500,
    "{a: " * 200 + "1" + "}" * 200,
    "rules:\n" + "  - name: n\n" * 2000,
    "\ufeffrules: []\n",
    "rules: [\x1b[31m]\n",
    "\t\x01\x02\x7f\u2028\U0001f600",
]
INTERESTING = [
    *DEVICE_IDS,
    *POLICIES,
    "root",
    "gpkowner",
    "gpkother",
    "fuzzvictim",
    "%s%n%x",
    "\n",
    "../../etc",
    "é",
    "\U0001f600" * 3,
    "\u202e",
    "a" * 300,
    "(" * 100,
    "[[:alpha:]",
    "\\",
    "*",
    ".*",
    "^$",
]
texts = st.one_of(
    st.text(CHARS, max_size=40),
    st.sampled_from(INTERESTING),
    # up to some KB: a short piece repeated (up to 8 Ki characters, so up to 32 KiB of UTF-8)
    st.builds(lambda piece, n: (piece * n)[:n], st.text(CHARS, min_size=1, max_size=8), st.integers(256, 8192)),
)
object_paths = st.one_of(
    st.sampled_from(["/", OBJECT_PATH, "/org", "/org/gpukill1/x", "/org/freedesktop/DBus"]),
    st.lists(st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True), max_size=4).map(lambda ps: "/" + "/".join(ps)),
)
signature_values = st.lists(single_sigs, max_size=3).map("".join).filter(lambda s: len(s) <= 255)


def values_of(sig: str, depth: int = 0) -> st.SearchStrategy:
    """Values of one complete type, as wire JSON."""
    from dbus_fast.signature import get_signature_tree

    (t,) = get_signature_tree(sig).types
    return _values(t, depth)


def _values(t, depth: int) -> st.SearchStrategy:
    tok = t.token
    if tok in INT_RANGES:
        return st.integers(*INT_RANGES[tok])
    if tok == "b":
        return st.booleans()
    if tok == "d":
        return st.floats()  # NaN, infinities, -0.0, subnormals, the largest finite values
    if tok == "s":
        return texts
    if tok == "o":
        return object_paths
    if tok == "g":
        return signature_values
    if tok == "v":
        return variants(depth + 1)
    if tok == "(":
        return st.tuples(*(_values(c, depth + 1) for c in t.children)).map(list)
    if tok == "a":
        (child,) = t.children
        if child.token == "y":
            return st.binary(max_size=64).map(bytes.hex)
        if child.token == "{":
            k, v = child.children
            return st.lists(st.tuples(_values(k, depth + 1), _values(v, depth + 1)).map(list), max_size=4)
        return st.lists(_values(child, depth + 1), max_size=4)
    raise AssertionError(f"no strategy for {t.signature!r}")


def variants(depth: int = 0) -> st.SearchStrategy:
    """A variant of any type (only basic types once MAX_VARIANT_DEPTH variants deep), as [signature, value]."""
    sigs = basic_sigs if depth >= MAX_VARIANT_DEPTH else st.one_of(basic_sigs, single_sigs)
    return sigs.flatmap(lambda s: values_of(s, depth).map(lambda v: [s, v]))


def options(typed: dict[str, tuple[str, ...]]) -> st.SearchStrategy:
    """An a{sv}: half the time documented keys, each with any value of one of its documented types (so the
    daemon gets past its key and type checks); else anything: documented and arbitrary keys, each with a
    variant of any type."""
    known = tuple(typed)

    def entry(key: str) -> st.SearchStrategy:
        return st.sampled_from(typed[key]).flatmap(lambda sig: values_of(sig).map(lambda val: [key, [sig, val]]))

    documented = st.lists(st.sampled_from(known), unique=True, max_size=len(known)).flatmap(
        lambda keys: st.tuples(*(entry(k) for k in keys)).map(list)
    )
    arbitrary = st.lists(st.tuples(st.one_of(st.sampled_from(known), texts), variants()).map(list), max_size=5)
    return st.one_of(documented, arbitrary)


# Documented keys and the types the daemon takes for them (manager.py), as the XML documents them and a few more.
FILTER_TYPES = {
    "device": ("s", "u", "y"),
    "user": ("s", "u"),
    "name": ("s",),
    "name_regex": ("s",),
    "min_memory": ("t", "u", "x"),
    "limit": ("u", "q", "y"),
    "after": ("(uu)",),
}
KILL_TYPES = {"force": ("b",), "grace": ("d", "u", "y", "t", "x")}
SELECTION_TYPES = {"tree": ("(ut)", "(uu)", "s"), "unit": ("s", "u"), "container": ("s",), "job": ("s", "u")}
# SuspendWorkload's and ResumeWorkload's (the testbed's GPUs are simulated: every suspend is refused)
WORKLOAD_TYPES = {"pid": ("(ut)", "(uu)", "s"), "tree": ("(ut)", "s"), "unit": ("s", "u"), "job": ("s", "u")}
RESET_TYPES = {"force": ("b",)}
AUDIT_SETTING_TYPES = {
    "min_score": ("d", "u"),
    "idle_after": ("d",),
    "idle_min_memory": ("t",),
    "abuser_share": ("d",),
    "abuser_window": ("d",),
    "pool_ports": ("aq",),
    "allowed_users": ("as",),
    "allowed_processes": ("as",),
}
AUDIT_TEXTS = ["[audit]\nmin_score = 10\n", "[audit]\nidle_after = nan\n", "[guard]\nx = 1\n", "{"]
USAGE_QUERY_TYPES = {
    "since": ("d", "t", "i"),
    "until": ("d", "x", "u"),
    "by": ("s",),
    "user": ("s", "u"),
    "name": ("s",),
    "unit": ("s",),
    "job": ("s",),
    "pod": ("s",),
    "device": ("s", "u"),
    "limit": ("u", "y"),
}
POLICY_SETTING_TYPES = {
    "memory_limit": ("t", "u"),
    "utilization_limit": ("d",),
    "process_limit": ("u",),
    "allowed_users": ("as",),
    "reserved_memory": ("t",),
    "grace": ("d",),
}
# (pid, start_time) of the victim, the bystander and gpukilld itself: filled in by the fixture, and read when
# an example is drawn (a strategy built over the list would keep the placeholders)
HINTS: dict[str, list[tuple[int, int]]] = {"targets": [(0, 0)] * 3}
hinted = st.sampled_from(range(3)).map(lambda i: HINTS["targets"][i])
any_pid, any_start = st.integers(*INT_RANGES["u"]), st.integers(*INT_RANGES["t"])
kill_targets = st.one_of(
    st.tuples(any_pid, any_start),
    hinted,  # a real process, exactly: the victim (on a GPU), the bystander (not), gpukilld (protected)
    st.tuples(hinted, any_start).map(lambda t: (t[0][0], t[1])),  # a real PID with another start time
    st.tuples(st.sampled_from([0, 1, 2, 2**31 - 1, 2**32 - 1]), any_start),
)
device_names = st.one_of(st.sampled_from(DEVICE_IDS), texts)
policy_texts = st.one_of(st.sampled_from(POLICIES), texts)

ARGS = {  # per method, the values of its arguments when it is called with its own signature
    "ListDevices": st.just([]),
    "AuditRogue": st.just([]),
    "ListProcesses": st.tuples(options(FILTER_TYPES)).map(list),
    "ListProcessesCompact": st.tuples(options(FILTER_TYPES)).map(list),  # the same filter
    "KillProcess": st.tuples(kill_targets, options(KILL_TYPES)).map(lambda t: [*t[0], t[1]]),
    "KillProcessReport": st.tuples(kill_targets, options(KILL_TYPES)).map(lambda t: [*t[0], t[1]]),
    # a documented or arbitrary selection, or the tree of a real process (exactly, or with another start time)
    "KillWorkload": st.tuples(
        st.one_of(options(SELECTION_TYPES), kill_targets.map(lambda t: [["tree", ["(ut)", list(t)]]])),
        options(KILL_TYPES),
    ).map(list),
    "ResetDevice": st.tuples(device_names, options(RESET_TYPES)).map(list),
    "Enable": st.just([]),
    "Disable": st.just([]),
    "GetStatus": st.just([]),
    "SetDryRun": st.tuples(st.booleans()).map(list),
    "LoadPolicy": st.tuples(texts, policy_texts).map(list),
    "TestPolicies": st.tuples(texts, policy_texts).map(list),
    "ListPolicies": st.just([]),
    "ExportPolicies": st.just([]),
    "SetPolicy": st.tuples(st.sampled_from(["user", "group", "gpu"]) | texts, texts, options(POLICY_SETTING_TYPES)).map(
        list
    ),
    "RemovePolicy": st.tuples(st.sampled_from(["user", "group", "gpu"]) | texts, texts).map(list),
    "ImportPolicies": st.tuples(texts, policy_texts, st.booleans()).map(list),
    "AuditRogueWith": st.tuples(options(AUDIT_SETTING_TYPES)).map(list),
    "GetAuditSettings": st.just([]),
    "ExportAuditSettings": st.just([]),
    "SetAuditSettings": st.tuples(options(AUDIT_SETTING_TYPES)).map(list),
    "ImportAuditSettings": st.tuples(texts, st.one_of(st.sampled_from(AUDIT_TEXTS), texts)).map(list),
    "GetUsage": st.tuples(options(USAGE_QUERY_TYPES)).map(list),
    # a real process or not, any number of seconds (nan, inf, negative, huge), any reason
    "Postpone": st.tuples(kill_targets, st.floats(), texts).map(lambda t: [*t[0], t[1], t[2]]),
    "SuspendWorkload": st.tuples(
        st.one_of(options(WORKLOAD_TYPES), kill_targets.map(lambda t: [["pid", ["(ut)", list(t)]]])),
        options(KILL_TYPES),
    ).map(list),
    "ResumeWorkload": st.tuples(
        st.one_of(options(WORKLOAD_TYPES), kill_targets.map(lambda t: [["pid", ["(ut)", list(t)]]])),
        options(KILL_TYPES),
    ).map(list),
    "ListSuspended": st.just([]),
}
assert set(ARGS) == {m for _, m in METHODS}

member_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True)
iface_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}(\.[A-Za-z_][A-Za-z0-9_]{0,12}){1,3}", fullmatch=True)
OUR_IFACES = [MANAGER, GUARD]
STANDARD_CALLS = [
    (INTROSPECTABLE, "Introspect", ""),
    (PEER, "Ping", ""),
    (PEER, "GetMachineId", ""),
    (OBJECT_MANAGER, "GetManagedObjects", ""),
]
flags = st.sampled_from([0, 0, 0, 0, 0, 0, 0, 4, 4, 1])  # none; ALLOW_INTERACTIVE_AUTHORIZATION; NO_REPLY
paths = st.sampled_from(range(8)).flatmap(lambda n: object_paths if n == 0 else st.just(OBJECT_PATH))


def body_of(sig: str) -> st.SearchStrategy[list]:
    from dbus_fast.signature import get_signature_tree

    types = get_signature_tree(sig).types
    return st.tuples(*(_values(t, 0) for t in types)).map(list)


def _spec(iface, member, sig, body, path=OBJECT_PATH, flag=0) -> dict:
    return {
        "dest": BUS_NAME,
        "path": path,
        "iface": iface,
        "member": member,
        "signature": sig,
        "body": body,
        "flags": flag,
    }


WEIGHTS = {"ListProcesses": 4, "KillProcess": 4, "ResetDevice": 3, "LoadPolicy": 3, "TestPolicies": 3}  # else 1


@st.composite
def our_method_well_typed(draw) -> dict:
    iface, member = draw(st.sampled_from([m for m in sorted(METHODS) for _ in range(WEIGHTS.get(m[1], 1))]))
    # the right interface mostly; sometimes none (matched by member) or the other of ours
    iface = draw(st.sampled_from([iface] * 8 + [None, GUARD if iface == MANAGER else MANAGER]))
    return _spec(
        iface, member, METHODS[(MEMBER_IFACE[member], member)][0], draw(ARGS[member]), OBJECT_PATH, draw(flags)
    )


@st.composite
def our_method_any_signature(draw) -> dict:
    iface, member = draw(st.sampled_from(sorted(METHODS)))
    right = METHODS[(iface, member)][0]
    sig = draw(
        st.one_of(
            body_sigs,
            single_sigs.map(lambda extra: right + extra),  # one argument too many
            st.just(right[:-1] if right and right[-1] not in "})" else ""),  # the last one cut (or none at all)
            st.just("a{ss}" if right == "a{sv}" else "sv"),
        ).filter(lambda s: len(s) <= 255)
    )
    iface = draw(st.sampled_from([iface, iface, None]))
    return _spec(iface, member, sig, draw(body_of(sig)), draw(paths), draw(flags))


prop_ifaces = st.one_of(
    st.sampled_from([MANAGER, MANAGER, GUARD, "", PROPS, INTROSPECTABLE, PEER, OBJECT_MANAGER]), iface_names, texts
)
prop_names = st.one_of(st.sampled_from(sorted({p for _, p in PROPERTIES})), member_names, texts)


@st.composite
def property_calls(draw) -> dict:
    member = draw(st.sampled_from(["Get", "Get", "GetAll", "Set", "Set", "Invalidate"]))
    kind = draw(st.sampled_from(["right", "right", "right", "any"]))
    if kind == "any" or member == "Invalidate":
        sig = draw(body_sigs)
        body = draw(body_of(sig))
    elif member == "Get":
        sig, body = "ss", [draw(prop_ifaces), draw(prop_names)]
    elif member == "GetAll":
        sig, body = "s", [draw(prop_ifaces)]
    else:
        sig, body = "ssv", [draw(prop_ifaces), draw(prop_names), draw(variants())]
    return _spec(PROPS, member, sig, body, draw(paths), draw(flags))


@st.composite
def standard_calls(draw) -> dict:
    iface, member, right = draw(st.sampled_from(STANDARD_CALLS))
    sig = draw(st.one_of(st.just(right), st.just(right), body_sigs))
    return _spec(iface, member, sig, draw(body_of(sig)), draw(paths), draw(flags))


@st.composite
def unknown_calls(draw) -> dict:
    iface = draw(
        st.one_of(
            st.sampled_from(
                [
                    *OUR_IFACES,
                    None,
                    PROPS,
                    PEER,
                    INTROSPECTABLE,
                    "org.gpukill1.Error",
                    "org.gpukill1",
                    "org.freedesktop.DBus.Monitoring",
                ]
            ),
            iface_names,
        )
    )
    member = draw(st.one_of(member_names, st.sampled_from([m for _, m in METHODS] + ["Get", "Ping", "Introspect"])))
    sig = draw(body_sigs)
    return _spec(iface, member, sig, draw(body_of(sig)), draw(paths), draw(flags))


CALL_KINDS = {  # kind of call -> its share of the examples
    our_method_well_typed: 20,
    our_method_any_signature: 3,
    property_calls: 3,
    standard_calls: 1,
    unknown_calls: 2,
}


# Every method and property once for sure, whatever the generator draws (hypothesis runs these first).
MINIMAL_ARGS = {
    "ListDevices": [],
    "AuditRogue": [],
    "ListProcesses": [[]],
    "ListProcessesCompact": [[]],
    "KillProcess": [2**32 - 1, 2**64 - 1, []],
    "KillProcessReport": [2**32 - 1, 2**64 - 1, []],
    "KillWorkload": [[], []],
    "ResetDevice": ["no-such-gpu", []],
    "Enable": [],
    "Disable": [],
    "GetStatus": [],
    "SetDryRun": [False],
    "LoadPolicy": ["explicit", "{"],
    "TestPolicies": ["explicit", "rules: []\n"],
    "ListPolicies": [],
    "ExportPolicies": [],
    "SetPolicy": ["user", "gpkfuzz", {}],
    "RemovePolicy": ["user", "gpkfuzz"],
    "ImportPolicies": ["explicit", "{", False],
    "AuditRogueWith": [[]],
    "GetAuditSettings": [],
    "ExportAuditSettings": [],
    "SetAuditSettings": [[]],
    "ImportAuditSettings": ["explicit", "{"],
    "GetUsage": [[]],
    "Postpone": [2**32 - 1, 2**64 - 1, 60.0, ""],
    "SuspendWorkload": [[], []],
    "ResumeWorkload": [[], []],
    "ListSuspended": [],
}
SET_VALUES = {"s": "9.9", "d": 0.001, "a(sbs)": [["fake", True, ""]], "a{sv}": {}}  # one of each property's type
EXPLICIT = [
    *(_spec(iface, member, METHODS[(iface, member)][0], MINIMAL_ARGS[member]) for iface, member in sorted(METHODS)),
    *(_spec(PROPS, "Get", "ss", [iface, name]) for iface, name in sorted(PROPERTIES)),
    *(
        _spec(PROPS, "Set", "ssv", [iface, name, [sig, SET_VALUES[sig]]])
        for (iface, name), sig in sorted(PROPERTIES.items())
    ),
    _spec(PROPS, "GetAll", "s", [MANAGER]),
    _spec(PROPS, "GetAll", "s", [GUARD]),
    *(_spec(iface, member, sig, []) for iface, member, sig in STANDARD_CALLS),
    _spec(MANAGER, "NoSuchMethod", "", []),
    _spec(GUARD, "ListDevices", "", []),
    _spec(None, "ListDevices", "", []),
    _spec("org.example.Nothing", "ListDevices", "", []),
]


@st.composite
def calls(draw) -> dict:
    kind = draw(st.sampled_from([k for k, n in CALL_KINDS.items() for _ in range(n)]))
    return draw(kind())


# -- the clients and the daemon's health ------------------------------------------------------------------------

# Tracebacks gpukilld's log may hold after a fuzz run: none. (The fuzz once found that dbus-fast logged every
# DBusError of a call sent with NO_REPLY_EXPECTED with its traceback; test_no_reply_calls_log_no_tracebacks
# keeps it fixed.) A pair here would be (log record header, start of the exception line).
KNOWN_LOG_TRACEBACKS: tuple[tuple[str, str], ...] = ()


@dataclass
class LogTraceback:
    offset: int  # bytes into the log
    header: str  # the log record the traceback belongs to
    exception: str  # its last line
    text: str

    @property
    def known(self) -> bool:
        return any(self.header == h and self.exception.startswith(e) for h, e in KNOWN_LOG_TRACEBACKS)


def log_tracebacks(log: bytes) -> list[LogTraceback]:
    """Every traceback in gpukilld's log (its records start with "gpukilld: ", see main.py)."""
    raw = log.splitlines(keepends=True)
    offsets = [0]
    for line in raw:
        offsets.append(offsets[-1] + len(line))
    lines = [line.decode(errors="replace").rstrip("\n") for line in raw]
    out, header = [], ""
    for i, line in enumerate(lines):
        if line.startswith("gpukilld: "):
            header = line
        elif line.startswith("Traceback (most recent call last):"):
            end = i + 1
            while end < len(lines) and lines[end].startswith(" "):  # the frames
                end += 1
            exception = lines[end] if end < len(lines) else ""
            out.append(LogTraceback(offsets[i], header, exception, "\n".join([header, *lines[i : end + 1]])[:3000]))
    return out


class Client:
    """One fuzz_client.py process running as a user; call() sends a spec and waits for its answer."""

    def __init__(self, bed: Testbed, user: User) -> None:
        self.user = user
        with open(bed.workdir / f"fuzz-{user.name}.err", "w") as err:
            self.proc = subprocess.Popen(
                [PYTHON, str(REPO / "tests" / "clients" / "fuzz_client.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=bed.env(),
                cwd="/",
                start_new_session=True,
                text=True,
                **user.popen_kwargs(),
            )
        bed.procs.append(self.proc)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._answer(30)
        assert hello.get("ready"), hello

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _answer(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return {"client_hung": True}
        return json.loads(line) if line else {"fatal": f"fuzz client exited ({self.proc.poll()})"}

    def call(self, spec: dict) -> dict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(spec) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"fatal": "fuzz client is gone"}
        return self._answer(CALL_TIMEOUT)


def _short(obj, limit: int = 1500) -> str:
    text = json.dumps(obj, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class Fuzz:
    def __init__(self, bed: Testbed, users: dict[str, User]) -> None:
        self.bed = bed
        self.users = users
        self.clients: dict[str, Client] = {}
        self.daemon_pid = bed.daemon.proc.pid
        self.calls = 0
        self.dead_after: str | None = None
        self.stats: dict[str, Counter] = {}
        self.detail: dict[str, Counter] = {}  # (call, outcome) -> count, printed with GPUKILL_FUZZ_VERBOSE=1
        self.slowest: dict[str, tuple[float, str]] = {}
        self.longest: dict[str, tuple[int, str]] = {}  # the longest error text and its name
        self.bystander: subprocess.Popen | None = None
        self.victim: subprocess.Popen | None = None
        self.safe_targets: set[int] = set()
        self.log_marks: list[tuple[int, str]] = []  # (size of gpukilld's log after a call, the call)

    def client(self, who: str) -> Client:
        if who not in self.clients:
            self.clients[who] = Client(self.bed, self.users[who])
        return self.clients[who]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.bed.daemon.log().splitlines()[-lines:]) if self.bed.daemon else "(no daemon)"

    def fail(self, why: str, spec: dict | None = None, answer: dict | None = None) -> None:
        text = why
        if spec is not None:
            text += f"\n  call: {_short(spec)}"
        if answer is not None:
            text += f"\n  answer: {_short(answer)}"
        text += f"\n  gpukilld log (last lines):\n{self.log_tail()}"
        pytest.fail(text, pytrace=False)

    def root_call(self, iface, member, sig="", body=None, dest=BUS_NAME, path=OBJECT_PATH) -> dict:
        spec = {
            "dest": dest,
            "path": path,
            "iface": iface,
            "member": member,
            "signature": sig,
            "body": body or [],
            "want_body": True,
        }
        return self.client("root").call(spec)

    def check_daemon(self, after: str) -> None:
        """The same gpukilld is alive, owns its name and answers."""
        if self.dead_after:
            self.fail(f"gpukilld is gone since {self.dead_after}")
        if self.bed.daemon.proc.poll() is not None:
            self.dead_after = after
            self.fail(f"gpukilld exited ({self.bed.daemon.proc.returncode}) {after}")
        r = self.root_call(
            "org.freedesktop.DBus",
            "NameHasOwner",
            "s",
            [BUS_NAME],
            dest="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
        )
        if not (r.get("ok") and r["body"] == [True]):
            self.dead_after = after
            self.fail(f"org.gpukill1 has no owner {after}", answer=r)
        r = self.root_call(
            "org.freedesktop.DBus",
            "GetConnectionUnixProcessID",
            "s",
            [BUS_NAME],
            dest="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
        )
        if not (r.get("ok") and r["body"] == [self.daemon_pid]):
            self.dead_after = after
            self.fail(f"org.gpukill1 is not owned by gpukilld (PID {self.daemon_pid}) {after}", answer=r)
        r = self.root_call(MANAGER, "ListProcesses", "a{sv}", [[]])
        if not (r.get("ok") and r.get("signature") == "aa{sv}"):
            self.fail(f"ListProcesses({{}}) does not answer {after}", answer=r)
        if self.bystander is not None and self.bystander.poll() is not None:
            self.fail(f"the bystander (PID {self.bystander.pid}, not on a GPU) was killed {after}")

    def reset_guard(self) -> None:
        """The guard as it started: disabled, not dry, no rules (the fuzz may have loaded a valid policy with
        kill rules and enabled it: the tests after it start their own victims)."""
        for member, sig, body in (
            ("Disable", "", []),
            ("SetDryRun", "b", [False]),
            ("LoadPolicy", "ss", ["reset", "rules: []\n"]),
        ):
            r = self.root_call(GUARD, member, sig, body)
            if not r.get("ok"):
                self.fail(f"resetting the guard: {member} failed", answer=r)

    def check_log(self, after: str) -> None:
        """No traceback in gpukilld's log (but those in KNOWN_LOG_TRACEBACKS, none today): an exception the
        daemon did not expect, even one that cost no caller anything, is a bug. Each is
        named with the call after which it was written (or, for work that finished later, one just before)."""
        if not self.bed.daemon:
            return
        unknown = [tb for tb in log_tracebacks(self.bed.daemon.log_path.read_bytes()) if not tb.known]
        if unknown:
            lines = []
            for tb in unknown[:5]:
                call = next((c for size, c in self.log_marks if size > tb.offset), "(no call: after the last one)")
                lines.append(f"--- after the call {call}\n{tb.text}")
            self.fail(f"{len(unknown)} unexpected traceback(s) in gpukilld's log {after}:\n" + "\n".join(lines))

    def harmless(self, spec: dict) -> bool:
        """False for a KillProcess (KillProcessReport, KillWorkload's tree) aimed at the exact (pid, start_time)
        of a process outside the testbed's
        targets: those the daemon must refuse, and the fuzz never asks (what matters must not depend on it)."""
        if spec["member"] == "KillWorkload" and spec["signature"] == "a{sv}a{sv}" and len(spec["body"]) == 2:
            tree = [e for e in spec["body"][0] if isinstance(e, list) and e and e[0] == "tree"]
            if not tree or tree[0][1][0] != "(ut)":
                return True  # a unit, container or job: the testbed's victim is in none
            pid, start = tree[0][1][1]
        elif (
            spec["member"] not in ("KillProcess", "KillProcessReport")
            or spec["signature"][:2] != "ut"
            or len(spec["body"]) < 2
        ):
            return True
        else:
            pid, start = spec["body"][0], spec["body"][1]
        if pid in self.safe_targets:
            return True
        try:
            return start_time_of(pid) != start
        except (AssertionError, OSError, ValueError):
            return True

    def check_call(self, who: str, spec: dict) -> None:
        assume(self.harmless(spec))
        note(f"as {who}: {_short(spec, 4000)}")
        if self.dead_after:
            self.fail(f"gpukilld is gone since {self.dead_after}", spec)
        answer = self.client(who).call(spec)
        self.log_marks.append((self.bed.daemon.log_path.stat().st_size, f"as {who}: {_short(spec, 600)}"))
        self.calls += 1
        self._count(who, spec, answer)
        where = f"after this call as {who}"
        if self.bed.daemon.proc.poll() is not None:
            self.dead_after = f"the call as {who}: {_short(spec)}"
            self.fail(f"gpukilld exited ({self.bed.daemon.proc.returncode}) {where}", spec, answer)
        if "fatal" in answer or "client_hung" in answer:
            self.fail(f"the {who} client lost its connection or hung (a disconnect) {where}", spec, answer)
        if "client_error" in answer:
            self.fail(f"the fuzz generated a call the client could not send (a test bug) as {who}", spec, answer)
        if answer.get("timeout"):
            self.fail(f"no reply in 30 s (a timeout) as {who}", spec, answer)
        if answer.get("noreply"):
            if "ping_error" in answer:
                self.fail(f"Peer.Ping after a NO_REPLY_EXPECTED call failed as {who}", spec, answer)
        elif not answer.get("ok"):
            name = answer.get("error", "")
            if name not in ALLOWED_ERRORS:
                self.fail(f"undocumented error {name!r} as {who}", spec, answer)
            message = answer.get("message", "")
            if "Traceback" in message or 'File "/' in message:
                self.fail(f"a Python traceback in the error text as {who}", spec, answer)
        else:
            self._check_success(who, spec, answer)
        if self.calls % CHECK_EVERY == 0:
            self.check_daemon(f"{self.calls} calls in, the last as {who}: {_short(spec, 300)}")

    def _check_success(self, who: str, spec: dict, answer: dict) -> None:
        iface, member, path = spec["iface"], spec["member"], spec["path"]
        if path != OBJECT_PATH or (iface is not None and iface not in OUR_IFACES):
            return
        home = MEMBER_IFACE.get(member)
        if home is None or (iface is not None and iface != home):
            self.fail(f"a call gpukilld does not offer succeeded as {who}", spec, answer)
        if answer.get("signature") != METHODS[(home, member)][1]:
            self.fail(
                f"{member} replied with signature {answer.get('signature')!r}, the XML says "
                f"{METHODS[(home, member)][1]!r}",
                spec,
                answer,
            )
        if who == "other" and member in PRIVILEGED:
            self.fail(f"the unprivileged user succeeded in {member}", spec, answer)

    def _count(self, who: str, spec: dict, answer: dict) -> None:
        c = self.stats.setdefault(who, Counter())
        key = (
            "ok"
            if answer.get("ok")
            else "noreply"
            if answer.get("noreply")
            else answer.get("error") or next(iter(answer), "?")
        )
        c[key] += 1
        self.detail.setdefault(who, Counter())[
            (f"{spec['iface']}.{spec['member']}({spec['signature'][:20]})", key)
        ] += 1
        if answer.get("message_len", 0) > self.longest.get(who, (0, ""))[0]:
            self.longest[who] = (answer["message_len"], answer.get("error", ""))
        elapsed = answer.get("elapsed", 0.0)
        if elapsed > self.slowest.get(who, (0.0, ""))[0]:
            self.slowest[who] = (elapsed, f"{spec['iface']}.{spec['member']}({spec['signature']})")


@pytest.fixture(scope="module")
def fuzz(users):
    """A private testbed of this module's own (the fuzz changes guard state: not the session's bed), with one
    victim on a simulated GPU (which the fuzz may kill) and one bystander that is on no GPU."""
    bed = Testbed()
    try:
        bed.start_system()
        f = Fuzz(bed, users)
        f.victim = bed.victim(users["owner"], gpu=0, mem="1GiB", comm="fuzzvictim")
        f.bystander = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        bed.procs.append(f.bystander)
        bed.wait_listed(f.victim.pid, comm="fuzzvictim")
        f.safe_targets = {f.victim.pid, f.bystander.pid, f.daemon_pid}
        HINTS["targets"][:] = [(p, start_time_of(p)) for p in (f.victim.pid, f.bystander.pid, f.daemon_pid)]
        f.check_daemon("at the start")
        yield f
        for who, counter in f.stats.items():
            slow = f.slowest.get(who, (0.0, ""))
            longest = f.longest.get(who, (0, ""))
            print(
                f"\nfuzz as {who}: {sum(counter.values())} calls, slowest {slow[0]:.2f}s {slow[1]}, longest "
                f"error text {longest[0]} characters ({longest[1]}); "
                + ", ".join(f"{k.removeprefix('org.freedesktop.DBus.Error.')}={n}" for k, n in counter.most_common())
            )
            if os.environ.get("GPUKILL_FUZZ_VERBOSE"):
                for (call, outcome), n in sorted(f.detail[who].items()):
                    print(f"  {n:4} {call} -> {outcome}")
    finally:
        bed.stop()


# -- the fuzz --------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Generating overly large repr")  # the strategies quote 1 MiB of examples
@pytest.mark.parametrize("who", ["other", "root", "admin"])
def test_fuzz_every_method_and_property(fuzz, who):
    start = time.monotonic()

    @seed(SEEDS[who] + SEED_OFFSET)
    @settings(
        max_examples=max(1, round(EXAMPLES[who] * SCALE)),
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(spec=calls())
    def run(spec):
        fuzz.check_call(who, spec)

    for spec in EXPLICIT:
        run = example(spec=spec)(run)

    run()
    fuzz.check_daemon(f"after the fuzz as {who} ({time.monotonic() - start:.1f}s)")
    time.sleep(0.5)  # what finishes after its reply (NO_REPLY_EXPECTED calls, polkit checks) has logged by now
    fuzz.check_log(f"after the fuzz as {who}")
    fuzz.reset_guard()


# -- regressions and known edges, as plain calls ------------------------------------------------------------------


def v(sig: str, value) -> list:
    return [sig, value]


def _expect(fuzz: Fuzz, who: str, spec: dict, errors: set[str | None], max_seconds: float = 10.0) -> dict:
    """The call answers within max_seconds with one of errors (None: success); then the daemon is well."""
    started = time.monotonic()
    answer = fuzz.client(who).call(spec)
    took = time.monotonic() - started
    got = None if answer.get("ok") else answer.get("error") or answer
    if got not in errors:
        fuzz.fail(f"expected one of {sorted(map(str, errors))} as {who}, got {got!r}", spec, answer)
    if took > max_seconds:
        fuzz.fail(f"took {took:.1f}s (more than {max_seconds}s) as {who}", spec, answer)
    assert "Traceback" not in answer.get("message", "")
    fuzz.check_daemon(f"after {spec['member']} as {who}")
    return answer


INVALID, DENIED = FDO + "InvalidArgs", FDO + "AccessDenied"


@pytest.mark.parametrize(
    "grace",
    [
        v("t", 2**64 - 1),
        v("x", 2**63 - 1),
        v("x", -(2**63)),
        v("d", float("nan")),
        v("d", float("inf")),
        v("d", -0.0 - 1e-300),
        v("u", 2**32 - 1),
    ],
)
def test_kill_grace_extremes(fuzz, grace):
    for who in ("other", "root"):
        for pid, start in ((2**32 - 1, 2**64 - 1), (fuzz.bystander.pid, start_time_of(fuzz.bystander.pid))):
            _expect(fuzz, who, _spec(MANAGER, "KillProcess", "uta{sv}", [pid, start, [["grace", grace]]]), {INVALID})
    assert fuzz.bystander.poll() is None


def test_kill_huge_ids_and_wrong_option_types(fuzz):
    nsp, notgpu = "org.gpukill1.Error.NoSuchProcess", "org.gpukill1.Error.NotAGpuProcess"
    for who in ("other", "root"):
        _expect(fuzz, who, _spec(MANAGER, "KillProcess", "uta{sv}", [2**32 - 1, 2**64 - 1, []]), {INVALID, nsp})
        _expect(
            fuzz,
            who,
            _spec(MANAGER, "KillProcess", "uta{sv}", [fuzz.bystander.pid, start_time_of(fuzz.bystander.pid), []]),
            {notgpu},
        )
        for opts in (
            [["force", v("t", 2**64 - 1)]],
            [["force", v("x", -(2**63))]],
            [["grace", v("(uu)", [1, 2])]],
            [["force", v("v", ["b", True])]],
            [["signal", v("u", 9)]],
            [["", v("b", True)]],
        ):
            _expect(fuzz, who, _spec(MANAGER, "KillProcess", "uta{sv}", [fuzz.bystander.pid, 1, opts]), {INVALID})
    assert fuzz.bystander.poll() is None


def test_filter_edges(fuzz):
    for who in ("other", "root"):
        # a 2,000-character regex: compiled (RE2) or refused, quickly, never a hang
        for rx in ("a" * 2000, "(a|b)*" * 333, "(" * 1000 + ")" * 1000, "[" * 2000, "\\p{L}" * 400):
            _expect(
                fuzz,
                who,
                _spec(MANAGER, "ListProcesses", "a{sv}", [[["name_regex", v("s", rx)]]]),
                {None, INVALID},
                max_seconds=5,
            )
        for filt in (
            [["limit", v("s", "10")]],
            [["limit", v("t", 5)]],
            [["limit", v("x", -1)]],
            [["limit", v("u", 0)]],
            [["limit", v("u", 2**32 - 1)]],
            [["limit", v("d", 1.0)]],
            [["after", v("(ss)", ["a", "b"])]],
            [["after", v("au", [1, 2])]],
            [["after", v("(uuu)", [1, 2, 3])]],
            [["after", v("u", 1)]],
            [["after", v("(ii)", [-1, -1])]],
            [["min_memory", v("d", float("nan"))]],
            [["user", v("b", True)]],
            [["device", v("as", ["0"])]],
        ):
            _expect(fuzz, who, _spec(MANAGER, "ListProcesses", "a{sv}", [filt]), {INVALID})
        ok = _expect(
            fuzz,
            who,
            _spec(MANAGER, "ListProcesses", "a{sv}", [[["limit", v("u", 1)], ["after", v("(uu)", [0, 0])]]]),
            {None},
        )
        assert ok["signature"] == "aa{sv}"


def test_policy_edges(fuzz):
    mib = ("rules: []\n# " + "x" * 80 + "\n") * ((1 << 20) // 84)
    for who in ("other", "root"):
        # a 1 MiB policy text: an answer (InvalidPolicy or decisions), never a timeout or a dead daemon
        _expect(
            fuzz,
            who,
            _spec(GUARD, "TestPolicies", "ss", ["big", mib]),
            {None, "org.gpukill1.Error.InvalidPolicy"},
            max_seconds=25,
        )
        _expect(
            fuzz,
            who,
            _spec(GUARD, "TestPolicies", "ss", ["big", mib + "x"]),
            {None, "org.gpukill1.Error.InvalidPolicy"},
            max_seconds=25,
        )
        _expect(
            fuzz,
            who,
            _spec(GUARD, "TestPolicies", "ss", ["bomb", BOMB]),
            {"org.gpukill1.Error.InvalidPolicy"},
            max_seconds=25,
        )
    # LoadPolicy as the unprivileged user: denied, whatever the text
    for text in ("rules: []\n", mib, "{"):
        _expect(fuzz, "other", _spec(GUARD, "LoadPolicy", "ss", ["x", text]), {DENIED})
    for member, sig, body in (("Enable", "", []), ("Disable", "", []), ("SetDryRun", "b", [True])):
        _expect(fuzz, "other", _spec(GUARD, member, sig, body), {DENIED})
    # as root the alias bomb is refused (as LoadPolicy parses in the daemon itself), quickly
    _expect(
        fuzz,
        "root",
        _spec(GUARD, "LoadPolicy", "ss", ["bomb", BOMB]),
        {"org.gpukill1.Error.InvalidPolicy"},
        max_seconds=10,
    )


def test_property_edges(fuzz):
    for who in ("other", "root"):
        _expect(fuzz, who, _spec(PROPS, "Get", "ss", [MANAGER, "NoSuchProperty"]), {FDO + "UnknownProperty"})
        _expect(fuzz, who, _spec(PROPS, "Get", "ss", [GUARD, "Version"]), {FDO + "UnknownProperty"})
        _expect(fuzz, who, _spec(PROPS, "Get", "ss", ["org.example.Nothing", "Version"]), {FDO + "UnknownInterface"})
        _expect(fuzz, who, _spec(PROPS, "Get", "ss", ["", "Version"]), {FDO + "NotSupported"})
        for name, value in (
            ("SampleInterval", v("d", 0.001)),
            ("Version", v("s", "9")),
            ("Backends", v("b", True)),
            ("NoSuchProperty", v("s", "x")),
        ):
            _expect(fuzz, who, _spec(PROPS, "Set", "ssv", [MANAGER, name, value]), {FDO + "PropertyReadOnly"})
        for (iface, name), sig in PROPERTIES.items():
            got = _expect(fuzz, who, _spec(PROPS, "Get", "ss", [iface, name]), {None})
            assert got["signature"] == "v", (name, sig, got)
        _expect(fuzz, who, _spec(PROPS, "GetAll", "s", [MANAGER]), {None})
        _expect(fuzz, who, _spec(PROPS, "Get", "s", [MANAGER]), {FDO + "UnknownMethod"})


def test_wrong_signatures_are_unknown_method(fuzz):
    """What dbus-fast answers for a real method called with another signature (the reason UnknownMethod is in
    ALLOWED_ERRORS): the handler is looked up by member and signature together."""
    for who in ("other", "root"):
        for member, sig, body in (
            ("ListDevices", "s", ["x"]),
            ("ListProcesses", "", []),
            ("KillProcess", "ut", [1, 1]),
            ("ResetDevice", "sa{ss}", ["0", []]),
        ):
            _expect(fuzz, who, _spec(MANAGER, member, sig, body), {FDO + "UnknownMethod"})
        _expect(fuzz, who, _spec(GUARD, "SetDryRun", "u", [1]), {FDO + "UnknownMethod"})
        _expect(fuzz, who, _spec(GUARD, "NoSuchMethod", "", []), {DENIED})
        _expect(fuzz, who, _spec(None, "NoSuchMethod", "", []), {DENIED})
        _expect(fuzz, who, _spec(INTROSPECTABLE, "Introspect", "s", ["x"]), {FDO + "UnknownMethod"})


def test_nothing_left_behind(fuzz):
    """The fuzz ran against its own testbed: the bystander lives, and the daemon is the one started."""
    fuzz.check_daemon("at the end")
    assert fuzz.bystander.poll() is None
    with contextlib.suppress(ProcessLookupError):
        os.kill(fuzz.daemon_pid, 0)
    assert Path(f"/proc/{fuzz.daemon_pid}").exists()


def test_kill_of_a_gpu_process(fuzz, users):
    """A GPU process of the owner: the unprivileged user is denied (whatever the options), an admin may."""
    fuzz.reset_guard()
    victim = fuzz.bed.victim(users["owner"], gpu=1, mem="1GiB", comm="fuzzvictim2")
    try:
        fuzz.bed.wait_listed(victim.pid, comm="fuzzvictim2")
        start = start_time_of(victim.pid)
        for opts in ([], [["force", v("b", True)]], [["force", v("b", True)], ["grace", v("d", 0.0)]]):
            _expect(fuzz, "other", _spec(MANAGER, "KillProcess", "uta{sv}", [victim.pid, start, opts]), {DENIED})
            _expect(fuzz, "other", _spec(None, "KillProcess", "uta{sv}", [victim.pid, start, opts]), {DENIED})
        _expect(fuzz, "other", _spec(MANAGER, "ResetDevice", "sa{sv}", ["1", [["force", v("b", True)]]]), {DENIED})
        assert victim.poll() is None
        _expect(
            fuzz,
            "other",
            _spec(MANAGER, "KillProcess", "uta{sv}", [victim.pid, start + 1, []]),
            {"org.gpukill1.Error.ProcessChanged"},
        )
        got = _expect(fuzz, "admin", _spec(MANAGER, "KillProcess", "uta{sv}", [victim.pid, start, []]), {None})
        assert got["signature"] == "s"
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def test_no_reply_calls_log_no_tracebacks(fuzz):
    """Found by the fuzz: a call sent with NO_REPLY_EXPECTED that ended in a D-Bus error made gpukilld write
    that error's traceback to its log (stderr, the journal under systemd): dbus-fast's
    _future_exception_no_reply logged the DBusError of every async method ("unexpected exception in future",
    7 lines), and its message reader the DBusError its Properties handler raised ("Unexpected error processing
    message", 7 lines). Any user could send such calls as fast as the bus takes them, past the folding of
    refusals.py, and push gpukilld over journald's rate limit. The door now drops questions nobody waits for,
    and errors of privileged calls nobody waits for are not raised (the refusal is still audited, folded)."""
    log = fuzz.bed.daemon.log_path
    before = log.stat().st_size
    calls = [
        _spec(MANAGER, "KillProcess", "uta{sv}", [1, 1, [["signal", v("u", 9)]]], flag=1),  # InvalidArgs
        _spec(GUARD, "SetDryRun", "b", [True], flag=1),  # AccessDenied (polkit)
        _spec(PROPS, "GetAll", "u", [1], flag=1),  # UnknownMethod, from dbus-fast's Properties handler
        _spec(PROPS, "Get", "ss", [MANAGER, "NoSuchProperty"], flag=1),  # UnknownProperty, likewise
        # UnknownObject, likewise, at a path where nothing is exported (found by the fuzz again)
        _spec(PROPS, "Set", "ssv", [MANAGER, "Version", v("s", "x")], path=OBJECT_PATH + "/x", flag=1),
    ]
    for spec in calls:
        got = fuzz.client("other").call(spec)
        assert got.get("noreply"), got
    time.sleep(1.0)  # the polkit check of SetDryRun answers after the Ping that follows the call
    fuzz.check_daemon("after the NO_REPLY_EXPECTED calls")
    written = log.read_bytes()[before:]
    tracebacks = log_tracebacks(written)
    assert not tracebacks, (
        f"{len(calls)} refused calls sent with NO_REPLY_EXPECTED by an unprivileged user wrote "
        f"{len(written.splitlines())} lines with {len(tracebacks)} tracebacks to gpukilld's log:\n"
        + written.decode(errors="replace")[:3000]
    )
