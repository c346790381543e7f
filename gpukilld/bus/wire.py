"""The daemon's records as D-Bus a{sv}, derived from their one declaration in gpukill/records/.

A value that is None is left out, never sent as 0; a field declared omit_empty is left out when empty or
false too (records.left_out). Nested records, lists of them and maps keyed by a field follow the field's
signature (see gpukill/records/base.py).
"""

from __future__ import annotations

import functools
from typing import Any

from dbus_fast import Variant

from gpukill.records.base import Wire, known_values, specs


def to_dbus(record: Any) -> dict[str, Variant]:
    """The record as an a{sv}, in the order of its fields."""
    out = {}
    # A class is Hashable, but mypy checks type[...] against Hashable by its unbound __hash__ (the ignore)
    for name, spec, plain in _fields(type(record)):  # type: ignore[arg-type]
        value = getattr(record, name)
        if value is None or (spec.omit_empty and not value):  # records.left_out, inlined: the hot path
            continue
        if plain:
            out[name] = Variant(spec.sig, list(value) if type(value) is tuple else value)
        else:
            out[name] = Variant(spec.sig, _value(spec, value))
    return out


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Wire, bool], ...]:
    """Each field with how it travels and whether its value goes as it is (no nested record)."""
    return tuple((name, spec, spec.of is None) for name, spec in specs(cls))


def _value(spec: Wire, value: Any) -> Any:
    if spec.of is None:
        return list(value) if isinstance(value, tuple) else value  # dbus-fast marshals arrays from lists
    if spec.key is not None:
        entry_sig = spec.sig[3:-1]  # a{sX}: X is "v" (each entry an a{sv} variant) or the entry's a{sT}
        if entry_sig == "v":
            return {getattr(e, spec.key): Variant("a{sv}", to_dbus_without(e, spec.key)) for e in value}
        return {getattr(e, spec.key): known_values(e, spec.key) for e in value}
    if spec.sig == "aa{sv}":
        return [to_dbus(e) for e in value]
    return to_dbus(value)


def to_dbus_without(record: Any, key: str) -> dict[str, Variant]:
    """A keyed map's entry as an a{sv}: the record but its key."""
    return {k: v for k, v in to_dbus(record).items() if k != key}
