"""Which GPUs a host has, from /sys/class/drm/card*/device: vendor, driver, PCI address or platform device,
card and render node minors, and a stable id.

A DRM card counts as a GPU here when it has a render node: display-only devices (a server's ASPEED BMC,
simpledrm) have none and are nobody's GPU. Cards bound to NVIDIA's proprietary driver belong to the NVML
backend and are left out, so a mixed host never lists one GPU twice.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from .sysfs import link_name, listdir, read_hex, read_text

DRM_MAJOR = 226  # include/uapi/drm/drm.h: every DRM card and render node is char 226:N
PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")

PCI_VENDORS = {
    0x1002: "amd",
    0x1022: "amd",
    0x8086: "intel",
    0x10DE: "nvidia",
    0x1AF4: "virtio",
    0x15AD: "vmware",
    0x1A03: "aspeed",
    0x5143: "qualcomm",
    0x1234: "qemu",
}
PLATFORM_VENDORS = {  # platform devices have no vendor file: the driver says whose GPU it is
    "asahi": "apple",
    "panfrost": "arm",
    "panthor": "arm",
    "lima": "arm",
    "msm": "qualcomm",
    "v3d": "broadcom",
    "vc4": "broadcom",
    "etnaviv": "vivante",
    "powervr": "imagination",
    "tegra": "nvidia",
    "rocket": "rockchip",
}
VENDOR_TITLES = {
    "amd": "AMD",
    "intel": "Intel",
    "apple": "Apple",
    "arm": "Arm Mali",
    "qualcomm": "Qualcomm Adreno",
    "broadcom": "Broadcom VideoCore",
    "nvidia": "NVIDIA",
}
NVML_DRIVERS = {"nvidia"}  # the proprietary driver: the nvidia backend reports these GPUs


@dataclass(frozen=True, slots=True)
class DrmCard:
    id: str  # stable: "GPU-<unique_id>" where the driver exposes one (amdgpu), else the PCI address or device name
    card: str  # "card0"
    card_minor: int
    render_minor: int
    driver: str  # the kernel driver bound to the device (amdgpu, i915, xe, msm, panfrost, asahi, ...)
    vendor: str
    name: str
    pci_address: str | None  # None for platform devices (Arm SoCs, Apple Silicon)
    device_path: str  # the device's sysfs directory (resolved), where telemetry lives
    card_path: str  # /sys/class/drm/cardN, where i915 keeps its frequency files


def _minor(path: str) -> int | None:
    """A `dev` attribute reads "226:128"."""
    text = read_text(path)
    if not text or ":" not in text:
        return None
    major, _, minor = text.partition(":")
    try:
        return int(minor) if int(major) == DRM_MAJOR else None
    except ValueError:
        return None


def _render_minor(device_path: str) -> int | None:
    for name in sorted(listdir(f"{device_path}/drm")):
        if name.startswith("renderD"):
            minor = _minor(f"{device_path}/drm/{name}/dev")
            if minor is not None:
                return minor
    return None


def _compatible(device_path: str) -> str | None:
    """The first device-tree compatible string ("apple,agx-t8103"): the closest a platform GPU has to a model."""
    try:
        with open(f"{device_path}/of_node/compatible", "rb") as f:
            first = f.read().split(b"\0")[0].decode("ascii", "replace").strip()
    except OSError:
        return None
    return first or None


def _card(sys_root: str, card: str) -> DrmCard | None:
    card_path = f"{sys_root}/class/drm/{card}"
    device_path = os.path.realpath(f"{card_path}/device")
    driver = link_name(f"{device_path}/driver")
    card_minor = _minor(f"{card_path}/dev")
    render_minor = _render_minor(device_path)
    if driver is None or driver in NVML_DRIVERS or card_minor is None or render_minor is None:
        return None
    base = os.path.basename(device_path)
    is_pci = link_name(f"{device_path}/subsystem") == "pci" or bool(PCI_ADDRESS.match(base))
    if is_pci:
        vendor_id, device_id = read_hex(f"{device_path}/vendor"), read_hex(f"{device_path}/device")
        vendor = PCI_VENDORS.get(vendor_id or -1, f"pci-{vendor_id or 0:04x}")
        name = read_text(f"{device_path}/product_name") or (  # amdgpu reads it from the board's FRU
            f"{VENDOR_TITLES.get(vendor, vendor)} GPU [{vendor_id or 0:04x}:{device_id or 0:04x}] ({driver})"
        )
    else:
        vendor = PLATFORM_VENDORS.get(driver, driver)
        compatible = _compatible(device_path)
        name = f"{VENDOR_TITLES.get(vendor, vendor)} GPU ({driver}{', ' + compatible if compatible else ''})"
    unique_id = read_text(f"{device_path}/unique_id")  # amdgpu, where the ASIC has a serial
    stable = f"GPU-{unique_id.lower()}" if unique_id else base
    return DrmCard(
        id=stable,
        card=card,
        card_minor=card_minor,
        render_minor=render_minor,
        driver=driver,
        vendor=vendor,
        name=name,
        pci_address=base if is_pci else None,
        device_path=device_path,
        card_path=card_path,
    )


# What _card made of each card directory, with what it was made from: the inodes of the card and of its device
# (sysfs makes new ones when a device is removed and added again, or its driver unbound and bound, which also
# re-creates the card) and the driver's name. While those stay the same, so do the attributes _card reads (ids,
# names, minors), and the walk (os.path.realpath alone costs ~0.1 ms a card) is not made again.
_KNOWN: dict[str, tuple[tuple[int, int, int, int, str], DrmCard | None]] = {}
_KNOWN_MAX = 256


def _identity(card_path: str) -> tuple[int, int, int, int, str] | None:
    try:
        card, device = os.stat(card_path), os.stat(f"{card_path}/device")
        # with change times: a file system that reuses inode numbers at once (a fixture tree) still shows it
        return (
            card.st_ino,
            card.st_ctime_ns,
            device.st_ino,
            device.st_ctime_ns,
            os.readlink(f"{card_path}/device/driver"),
        )
    except OSError:
        return None  # no device, or no driver bound: _card says what that means, every time


def discover(sys_root: str = "/sys") -> list[DrmCard]:
    """Every GPU under sys_root, in card order. Cheap enough to run every sample, so hot-plug and unbinding show."""
    cards = [c for c in listdir(f"{sys_root}/class/drm") if re.fullmatch(r"card\d+", c)]
    found: list[DrmCard] = []
    for card in sorted(cards, key=lambda c: int(c[4:])):
        card_path = f"{sys_root}/class/drm/{card}"
        identity = _identity(card_path)
        known = _KNOWN.get(card_path)
        if identity is not None and known is not None and known[0] == identity:
            drm_card = known[1]
        else:
            drm_card = _card(sys_root, card)
            if identity is not None:
                if len(_KNOWN) >= _KNOWN_MAX:
                    _KNOWN.clear()
                _KNOWN[card_path] = (identity, drm_card)
        if drm_card is None:
            continue
        if any(c.id == drm_card.id for c in found):  # a serial two cards share cannot name either alone
            drm_card = dataclasses.replace(drm_card, id=os.path.basename(drm_card.device_path))
        found.append(drm_card)
    return found
