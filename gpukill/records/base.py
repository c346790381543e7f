"""How a record is declared (wire()) and what is derived from the declaration alone: the order of its keys,
what is left out on the bus, and the plain (JSON) form. The records themselves are in the modules beside
this one; gpukill/records/__init__.py says why they are split.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import field
from typing import Any, NamedTuple

_REQUIRED: Any = dataclasses.MISSING


# A NamedTuple, not a dataclass as the records are: it is no record, only what wire() attaches to a field, and
# a class statement of a dataclass compiles its generated methods at every start (~0.4 ms; a NamedTuple's ~0.05)
class Wire(NamedTuple):
    """How one field travels: its D-Bus signature, its meaning, and when it is left out."""

    sig: str
    doc: str
    omit_empty: bool = False  # left out when empty or false too, not only when None
    of: type | None = None  # the record type of a nested record, list or keyed map
    key: str | None = None  # for a keyed map: the field of `of` whose value is the key


def wire(
    sig: str,
    doc: str,
    default: Any = _REQUIRED,
    *,
    omit_empty: bool = False,
    of: type | None = None,
    key: str | None = None,
) -> Any:
    """A dataclass field that travels on the bus with this signature."""
    return field(default=default, metadata={"wire": Wire(sig, doc, omit_empty, of, key)})


@functools.cache
def specs(cls: type) -> tuple[tuple[str, Wire], ...]:
    """The record's fields in order, each with how it travels. A field declared without wire() (the daemon's
    GpuProcess.system_unit) is not on the bus, nor in the plain form."""
    return tuple((f.name, f.metadata["wire"]) for f in dataclasses.fields(cls) if "wire" in f.metadata)


def names(cls: type) -> tuple[str, ...]:
    """The record's keys, in the order of the bus and of JSON."""
    return tuple(name for name, _ in specs(cls))


def left_out(spec: Wire, value: Any) -> bool:
    """Whether the value is left out of the record on the bus."""
    return value is None or (spec.omit_empty and not value)


# -- the plain form: JSON, and what the client holds once the variants are unwrapped -------------------------


def to_plain(record: Any) -> dict[str, Any]:
    """Every field in order, JSON-ready: null where the bus leaves the value out (false for a flag)."""
    out: dict[str, Any] = {}
    cls: type = type(record)  # as `type`: mypy takes type[Any] for unhashable (the cache's argument)
    for name, spec in specs(cls):
        value = getattr(record, name)
        # left_out() and _plain_value() written out for the commonest cases: `list --json` runs this for every
        # field of every process (~4,600 times for 256), where the two calls cost more than the work
        if value is None or (spec.omit_empty and not value):
            out[name] = False if value is False else None
        elif spec.of is None and not isinstance(value, tuple):
            out[name] = value
        else:
            out[name] = _plain_value(spec, value)
    return out


def _plain_value(spec: Wire, value: Any) -> Any:
    if spec.of is None:
        return list(value) if isinstance(value, tuple) else value
    if spec.key is not None:
        return {getattr(entry, spec.key): known_values(entry, spec.key) for entry in value}
    if spec.sig == "aa{sv}":
        return [to_plain(entry) for entry in value]
    return to_plain(value)


def known_values(record: Any, key: str | None = None) -> dict[str, Any]:
    """A keyed map's entry: the record's values that are not left out, but its key."""
    cls: type = type(record)  # as in to_plain
    return {
        name: _plain_value(spec, value)
        for name, spec in specs(cls)
        if name != key and not left_out(spec, value := getattr(record, name))
    }


def from_plain(cls: type, data: dict[str, Any]) -> Any:
    """The record from a plain dict (JSON, or an a{sv} with its variants unwrapped). Keys it does not
    declare are ignored (a newer daemon may send more); a value of the wrong type counts as left out."""
    values = {}
    for name, spec in specs(cls):
        value = _from_plain_value(spec, data.get(name))
        if value is not None:
            values[name] = value
    return cls(**values)


def _from_plain_value(spec: Wire, value: Any) -> Any:
    if value is None:
        return None
    if spec.of is None:
        return _scalar(spec.sig, value)
    if spec.key is not None:
        if not isinstance(value, dict):
            return None
        return tuple(
            from_plain(spec.of, {**entry, spec.key: k})
            for k, entry in value.items()
            if isinstance(k, str) and isinstance(entry, dict)
        )
    if spec.sig == "aa{sv}":
        if not isinstance(value, list | tuple):
            return None
        return tuple(from_plain(spec.of, e) for e in value if isinstance(e, dict))
    return from_plain(spec.of, value) if isinstance(value, dict) else None


_INT_RANGE = {"q": 1 << 16, "u": 1 << 32, "t": 1 << 64}


def _scalar(sig: str, value: Any) -> Any:
    """The value as its signature's Python type, or None when it is not one."""
    if sig in ("as", "au", "aq", "at"):
        if not isinstance(value, list | tuple):
            return None
        items = [_scalar(sig[1], v) for v in value]
        return None if None in items else tuple(items)
    if sig == "b":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return None
    if sig == "s":
        return value if isinstance(value, str) else None
    if sig == "d":
        return float(value) if isinstance(value, int | float) else None
    if sig in _INT_RANGE:
        return value if isinstance(value, int) and 0 <= value < _INT_RANGE[sig] else None
    raise ValueError(f"no plain form for signature {sig!r}")
