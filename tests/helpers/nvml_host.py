"""A fake NVIDIA host for tests and benches: the C fake libnvidia-ml built with cc, a JSON state that the
library re-reads when it changes, and a fake nvidia-smi that records resets. pynvml loads it as the real one.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "fake_nvml"
SOURCE = HERE / "fake_nvml.c"


def build_fake_nvml(outdir: Path, optimize: str = "-O2") -> Path:
    """Compile the fake into outdir/libnvidia-ml.so.1 (with that soname, so a preloaded copy satisfies
    pynvml's dlopen in the same process). `optimize` is cc's -O flag: a test builds at -O0 too, where
    undefined behaviour that -O2 happens to hide (a double out of range converted to an integer) shows.
    Raises RuntimeError when there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the fake libnvidia-ml")
    outdir.mkdir(parents=True, exist_ok=True)
    lib = outdir / "libnvidia-ml.so.1"
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            optimize,
            "-Wall",
            "-Werror",
            "-Wno-unused-parameter",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            str(lib),
            str(SOURCE),
            "-lpthread",
        ],
        check=True,
    )
    os.chmod(outdir, 0o755)
    return lib


def h100(i: int) -> dict:
    return {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-4b1d6c2e-0000-4000-8000-{i:012x}",
        "pci_bus_id": f"00000000:{0x18 + i * 0x10:02X}:00.0",
        "memory_total": 85520809984,
        "memory_reserved": 536870912,
        "memory_allocated": 0,
        "util_gpu": 10 + i,
        "util_memory": 3 + i,
        "temperature": 40 + i,
        "power_mw": 70000 + i * 1000,
        "power_limit_mw": 700000,
        "compute": [],
        "graphics": [],
        "mps": [],
        "process_util": [],
    }


def mig_instance(uuid: str, gi: int, ci: int, total: int, reserved: int = 0) -> dict:
    """A MIG device for a GPU's "mig_devices"; its memory follows nvml.h as a GPU's does (see fake_nvml.c)."""
    return {
        "uuid": uuid,
        "gi": gi,
        "ci": ci,
        "memory_total": total,
        "memory_reserved": reserved,
        "memory_allocated": 0,
        "compute": [],
        "graphics": [],
        "mps": [],
    }


def _allocated(device: dict) -> int:
    """What a device's processes hold: its "memory_allocated" (nvml.h's allocated, v2's used)."""
    return sum(p.get("used_memory", 0) for k in ("compute", "graphics", "mps") for p in device.get(k, []))


class FakeNvidiaHost:
    def __init__(self, workdir: Path | None = None, devices: int = 8, optimize: str = "-O2") -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="gpukill-nvml-"))
        os.chmod(self.dir, 0o755)
        self.lib = build_fake_nvml(self.dir / "lib", optimize)
        self.bin = self.dir / "bin"
        self.bin.mkdir(exist_ok=True)
        shutil.copy(HERE / "nvidia-smi", self.bin / "nvidia-smi")
        os.chmod(self.bin, 0o755)
        self.state_path = self.dir / "state.json"
        self.smi_log = self.dir / "nvidia-smi.log"
        self.counts_path = self.dir / "nvml-counts"  # the library's own totals of init/shutdown and event sets
        self.calls_path = self.dir / "nvml-calls"  # every NVML call, counted by the library (see calls())
        self.state: dict = {
            "driver_version": "550.54.15",
            "devices": [h100(i) for i in range(devices)],
            "xid_events": [],
        }
        self.write()

    def write(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.state_path)  # atomic: the library never reads half a file
        # the library compares mtimes; make sure two writes within one timestamp tick differ
        st = os.stat(self.state_path)
        os.utime(self.state_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))

    def device(self, i: int) -> dict:
        return self.state["devices"][i]

    def add_process(
        self,
        i: int,
        pid: int,
        memory: int | None,
        kind: str = "compute",
        sm: int | None = None,
        timestamp: int = 1,
        mig: int | None = None,
    ) -> None:
        """A process on GPU i (or on its MIG device number `mig`); memory None: NVML does not know it. The
        device's allocated memory, and the parent's with it, follow the processes' (as on a driver)."""
        entry: dict = {"pid": pid}
        if memory is not None:
            entry["used_memory"] = memory
        gpu = self.device(i)
        device = gpu if mig is None else gpu["mig_devices"][mig]
        device[kind].append(entry)
        if sm is not None:
            gpu["process_util"].append({"pid": pid, "sm": sm, "mem": 1, "timestamp": timestamp})
        device["memory_allocated"] = _allocated(device)
        gpu["memory_allocated"] = _allocated(gpu) + sum(m["memory_allocated"] for m in gpu.get("mig_devices", []))

    def fault(self, i: int, **faults) -> None:
        self.device(i).setdefault("faults", {}).update(faults)
        self.write()

    def clear_faults(self, i: int) -> None:
        self.device(i).pop("faults", None)
        self.write()

    def env(self, with_library: bool = True) -> dict[str, str]:
        env = {
            "GPUKILL_FAKE_NVML_STATE": str(self.state_path),
            "GPUKILL_FAKE_SMI_LOG": str(self.smi_log),
            "GPUKILL_FAKE_NVML_COUNTS": str(self.counts_path),
            "GPUKILL_FAKE_NVML_CALLS": str(self.calls_path),
            "PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin",
        }
        if with_library:
            env["LD_LIBRARY_PATH"] = str(self.lib.parent)
        return env

    def resets(self) -> list[list[str]]:
        if not self.smi_log.exists():
            return []
        return [json.loads(line) for line in self.smi_log.read_text().splitlines()]

    def counts(self) -> dict[str, int]:
        """nvmlInit, nvmlShutdown, nvmlEventSetCreate and nvmlEventSetFree calls so far, by the last process that
        loaded the library with this host's env (the file is the library's; each process counts from 0)."""
        if not self.counts_path.exists():
            return {"init": 0, "shutdown": 0, "event_set_create": 0, "event_set_free": 0}
        return {name: int(n) for name, n in (line.split() for line in self.counts_path.read_text().splitlines())}

    def calls(self) -> int:
        """NVML calls made so far by every process that loaded the library with this host's env: a 64-bit counter
        the library keeps in a shared mapping of calls_path (0 before the first call)."""
        try:
            data = self.calls_path.read_bytes()
        except FileNotFoundError:
            return 0
        return int.from_bytes(data[:8], "little") if len(data) >= 8 else 0

    def snapshot(self) -> dict:
        return copy.deepcopy(self.state)


def fake_nvidia_host(workdir: Path, devices: int = 8, optimize: str = "-O2") -> FakeNvidiaHost:
    """For a fixture: a FakeNvidiaHost with `devices` H100s in workdir (made if missing); skips the test, with the
    reason, where there is no C compiler to build the fake library."""
    import pytest  # here, so that benches use this module without pytest

    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return FakeNvidiaHost(workdir, devices=devices, optimize=optimize)
    except RuntimeError as e:
        pytest.skip(str(e))
