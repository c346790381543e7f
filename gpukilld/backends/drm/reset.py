"""Resetting a DRM GPU: how, whether it can be done at all, and which other GPUs go with it.

    amdgpu     read <debugfs>/dri/<minor or PCI address>/amdgpu_gpu_recover: the driver runs its full GPU
               recovery and the read returns its result ("0" or a negative errno)
    PCI        write "1" to /sys/bus/pci/devices/ADDR/reset (Intel and any other PCI GPU): the kernel tries
               the methods listed in reset_method in order; an empty reset_method means resets are disabled
    platform   SoC GPUs (asahi, panfrost, msm, ...) have no reset interface: NotSupported

An amdgpu in an XGMI hive is recovered with every GPU of its hive; sysfs shows the hive as
xgmi_hive_info/xgmi_hive_id and node1..nodeN links to its members, and the result says so.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from gpukill.errors import NotSupported, ResetFailed

from .discovery import DrmCard
from .sysfs import listdir, read_text

AMDGPU_RECOVER = "amdgpu_gpu_recover"


@dataclass(frozen=True, slots=True)
class ResetPlan:
    card: DrmCard
    method: str  # "amdgpu_gpu_recover" or "pci"
    path: str
    pci_methods: str = ""  # reset_method, for the message
    hive_id: str | None = None
    peers: tuple[str, ...] = ()  # PCI addresses of the other GPUs of the XGMI hive, reset too

    @property
    def peers_note(self) -> str:
        if not self.peers:
            return ""
        return f"; XGMI hive {self.hive_id}: its peers {', '.join(self.peers)} are reset with it"


def xgmi_hive(card: DrmCard, cards: list[DrmCard]) -> tuple[str | None, tuple[str, ...]]:
    """(hive id, the other members' PCI addresses) for an amdgpu in an XGMI hive, else (None, ())."""
    hive_dir = f"{card.device_path}/xgmi_hive_info"
    hive_id = read_text(f"{hive_dir}/xgmi_hive_id")
    if not hive_id:
        return None, ()
    members = {os.path.basename(os.path.realpath(f"{hive_dir}/{n}")) for n in listdir(hive_dir) if n.startswith("node")}
    for other in cards:  # members whose node link is missing still share the hive id
        if other.driver == "amdgpu" and read_text(f"{other.device_path}/xgmi_hive_info/xgmi_hive_id") == hive_id:
            members.add(other.pci_address or other.id)
    members.discard(card.pci_address or card.id)
    return hive_id, tuple(sorted(members))


def plan_reset(card: DrmCard, cards: list[DrmCard], sys_root: str, debugfs_root: str) -> ResetPlan:
    """How this card would be reset; NotSupported (nothing done) when it cannot be."""
    where = f"{card.name} ({card.id})"
    if card.driver == "amdgpu":
        candidates = [f"{debugfs_root}/dri/{card.card_minor}/{AMDGPU_RECOVER}"]
        if card.pci_address:
            candidates.append(f"{debugfs_root}/dri/{card.pci_address}/{AMDGPU_RECOVER}")
        path = next((p for p in candidates if os.path.exists(p)), None)
        if path is None:
            raise NotSupported(
                f"reset of {where} needs debugfs: {candidates[0]} not found "
                f"(mount debugfs at {debugfs_root}, or set [paths] debugfs)"
            )
        hive_id, peers = xgmi_hive(card, cards)
        return ResetPlan(card, AMDGPU_RECOVER, path, hive_id=hive_id, peers=peers)
    if card.pci_address is None:
        raise NotSupported(
            f"reset is not supported on {where}: the {card.driver} driver of this platform "
            "device has no reset interface"
        )
    pci = f"{sys_root}/bus/pci/devices/{card.pci_address}"
    if not os.path.exists(f"{pci}/reset"):
        raise NotSupported(
            f"reset is not supported on {where}: the kernel offers no reset for PCI device "
            f"{card.pci_address} (no {pci}/reset)"
        )
    methods = read_text(f"{pci}/reset_method")
    if methods is not None and not methods:
        raise NotSupported(
            f"reset is not supported on {where}: resets are disabled for {card.pci_address} (its reset_method is empty)"
        )
    return ResetPlan(card, "pci", f"{pci}/reset", pci_methods=methods or "")


def _errno_text(code: int) -> str:
    name = errno.errorcode.get(code, str(code))
    return f"{os.strerror(code)} ({name})"


def execute(plan: ResetPlan) -> str:
    """Run the reset; the one-line result, or ResetFailed with the kernel's answer."""
    card = plan.card
    where = card.pci_address or card.id
    if plan.method == AMDGPU_RECOVER:
        try:
            with open(plan.path, encoding="ascii", errors="replace") as f:
                answer = f.read().strip()  # blocks until the recovery has run
        except OSError as e:
            raise ResetFailed(
                f"amdgpu recovery of {where} could not start: {plan.path}: {e.strerror}{plan.peers_note}"
            ) from None
        try:
            result = int(answer)
        except ValueError:
            raise ResetFailed(
                f"amdgpu recovery of {where}: unexpected answer {answer[:40]!r} from {plan.path}{plan.peers_note}"
            ) from None
        if result != 0:
            raise ResetFailed(f"amdgpu recovery of {where} failed: {_errno_text(-result)}{plan.peers_note}")
        return f"amdgpu GPU recovery of {where} done{plan.peers_note}"
    try:
        with open(plan.path, "w", encoding="ascii") as f:
            f.write("1")
    except OSError as e:
        raise ResetFailed(f"PCI reset of {where} failed: {e.strerror}") from None
    methods = f" (methods tried in order: {plan.pci_methods})" if plan.pci_methods else ""
    return f"PCI reset of {where} done{methods}"
