"""AMD telemetry through pyrsmi (ROCm SMI) where pyrsmi and ROCm's library are installed; sysfs otherwise.

pyrsmi answers -1 for a value it cannot read; that becomes None here and the sysfs reading fills in, field by
field. Devices are matched by PCI address (rsmi's BDF id: domain << 32 | bus << 8 | device << 3 | function),
never by index, since ROCm and DRM number devices differently.
"""

from __future__ import annotations

import logging
from typing import Any

from .telemetry import Telemetry

log = logging.getLogger(__name__)


def bdf_to_address(bdf: int) -> str:
    return f"{bdf >> 32:04x}:{(bdf >> 8) & 0xFF:02x}:{(bdf >> 3) & 0x1F:02x}.{bdf & 0x7}"


def _value(rocml: Any, function: str, index: int) -> float | None:
    try:
        v = getattr(rocml, function)(index)
    except Exception:  # a call missing from this pyrsmi, or failing for one value, must not cost the others
        return None
    return None if v is None or v < 0 else v


class RsmiSource:
    """pyrsmi, initialized once; `available` False (with `reason`) where it cannot be used."""

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self._rocml: Any = None
        self._index: dict[str, int] = {}
        try:
            from pyrsmi import rocml  # optional: the `amd` extra
        except ImportError:
            self.reason = "pyrsmi is not installed; AMD telemetry from sysfs"
            return
        try:
            rocml.smi_initialize()
            for i in range(rocml.smi_get_device_count()):
                bdf = rocml.smi_get_device_pci_id(i)
                if bdf is not None and bdf >= 0:
                    self._index[bdf_to_address(bdf)] = i
        except Exception as e:  # no ROCm library, or the driver is not loaded
            self.reason = f"pyrsmi could not start ROCm SMI ({e}); AMD telemetry from sysfs"
            return
        self._rocml = rocml
        self.available = True
        self.reason = f"pyrsmi: {len(self._index)} AMD GPUs"

    def read(self, pci_address: str | None) -> Telemetry | None:
        """What ROCm SMI knows of the device at pci_address; None if it does not know that device."""
        index = self._index.get(pci_address or "")
        if not self.available or index is None:
            return None
        r = self._rocml
        t = Telemetry()
        busy = _value(r, "smi_get_device_utilization", index)
        t.utilization = None if busy is None else float(busy)
        used, total = _value(r, "smi_get_device_memory_used", index), _value(r, "smi_get_device_memory_total", index)
        t.memory_used = None if used is None else int(used)
        t.memory_total = None if total is None else int(total)
        t.power = _value(r, "smi_get_device_average_power", index)  # watts already
        return t

    def close(self) -> None:
        if self.available:
            try:
                self._rocml.smi_shutdown()
            except Exception as e:
                log.debug("pyrsmi shutdown: %s", e)
            self.available = False


def merge(first: Telemetry | None, fallback: Telemetry) -> Telemetry:
    """pyrsmi's values first, sysfs for whatever pyrsmi did not give."""
    if first is None:
        return fallback
    return Telemetry(
        **{
            name: getattr(first, name) if getattr(first, name) is not None else getattr(fallback, name)
            for name in Telemetry.__slots__
        }
    )
