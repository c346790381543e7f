"""A fake NVIDIA host for tests and benches: the C fake libnvidia-ml built with cc, a JSON state that the
library re-reads when it changes, a fake nvidia-smi that records resets, and, once installed, a fake
cuda-checkpoint sharing the state (tests/helpers/fake_cuda_checkpoint/). pynvml loads the library as the real one.
"""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent / "fake_nvml"
SOURCE = HERE / "fake_nvml.c"
FAKE_CUDA_CHECKPOINT = Path(__file__).resolve().parent / "fake_cuda_checkpoint" / "cuda-checkpoint"
PEER_VIEW = Path(__file__).resolve().parents[1] / "clients" / "nvml_peer_view.py"


def fake_cuda_checkpoint() -> ModuleType:
    """The fake cuda-checkpoint as a module: the owner of how both states are locked and written."""
    loader = importlib.machinery.SourceFileLoader("fake_cuda_checkpoint", str(FAKE_CUDA_CHECKPOINT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_checkpoint = fake_cuda_checkpoint()


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
        self.checkpoint_state_path = self.dir / "cuda-checkpoint-state.json"  # the fake cuda-checkpoint's own
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
        """self.state to the file, whole (the library never reads half a file), its mtime moved past the last
        write's, under the lock the fake cuda-checkpoint takes. After the fake changed the state, refresh()
        before changing it here, or this write undoes what the fake did."""
        with _checkpoint.nvml_lock(str(self.state_path)):
            _checkpoint.write_nvml_state(str(self.state_path), self.state)

    def refresh(self) -> dict:
        """self.state as the file has it now (the fake cuda-checkpoint writes it too)."""
        with _checkpoint.nvml_lock(str(self.state_path)):
            self.state = json.loads(self.state_path.read_text())
        return self.state

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

    def install_cuda_checkpoint(self) -> Path:
        """The fake cuda-checkpoint in this host's bin (on env()'s PATH), beside the JSON naming both states, so it
        finds them under a daemon that starts it with a clean environment; its path, for gpukilld.conf's
        `cuda_checkpoint = PATH`."""
        path = self.bin / "cuda-checkpoint"
        shutil.copy(FAKE_CUDA_CHECKPOINT, path)
        os.chmod(path, 0o755)
        beside = {"nvml_state": str(self.state_path), "state": str(self.checkpoint_state_path)}
        Path(f"{path}.json").write_text(json.dumps(beside))
        if not self.checkpoint_state_path.exists():
            self._update_checkpoint_state(lambda own: None)
        return path

    def _update_checkpoint_state(self, change) -> None:
        with _checkpoint.nvml_lock(str(self.state_path)):
            own = _checkpoint.load(str(self.checkpoint_state_path))
            change(own)
            _checkpoint.write_json(str(self.checkpoint_state_path), own)

    def checkpoint_fault(self, pid: int, **faults) -> None:
        """Inject failures of the fake cuda-checkpoint for one process (its header lists them: lock_timeout,
        checkpoint_error, checkpoint_error_state, restore_oom, hang)."""
        self._update_checkpoint_state(lambda own: own.setdefault("faults", {}).setdefault(str(pid), {}).update(faults))

    def clear_checkpoint_faults(self, pid: int) -> None:
        self._update_checkpoint_state(lambda own: own.get("faults", {}).pop(str(pid), None))

    def set_checkpoint_copy_rate(self, gib_per_s: float | None) -> None:
        """Checkpoint and restore take the process's memory over this rate (None: at once)."""
        self._update_checkpoint_state(lambda own: own.update(copy_gib_per_s=gib_per_s))

    def set_checkpoint_stopped_wait(self, seconds: float | None) -> None:
        """How long an action without --timeout waits for a stopped or frozen process before it fails as timed out
        (None: the fake's STOPPED_WAIT)."""
        self._update_checkpoint_state(lambda own: own.update(stopped_wait_s=seconds))

    def checkpoint_states(self) -> dict[int, str]:
        """The driver state of every process the fake cuda-checkpoint has seen: running, locked, checkpointed,
        failed."""
        own = _checkpoint.load(str(self.checkpoint_state_path))
        return {int(pid): r["state"] for pid, r in own.get("processes", {}).items()}

    def checkpoint_calls(self) -> list[dict]:
        """Every run of the fake cuda-checkpoint, in order: op, pid, timeout_ms, before, after (states), rc, error
        (a CUDA error name or None), slept and seconds (inside the interpreter)."""
        log = Path(f"{self.checkpoint_state_path}.log")
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    def env(self, with_library: bool = True) -> dict[str, str]:
        env = {
            "GPUKILL_FAKE_NVML_STATE": str(self.state_path),
            "GPUKILL_FAKE_CUDA_CHECKPOINT_STATE": str(self.checkpoint_state_path),
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


def peer_view(host: FakeNvidiaHost, symbols=()) -> dict:
    """What nvitop and plain pynvml read from the host (tests/clients/nvml_peer_view.py, in its own process)."""
    import pytest

    if importlib.util.find_spec("nvitop") is None:
        pytest.skip("nvitop is not installed (pip install -e '.[test]')")
    r = subprocess.run(
        [sys.executable, str(PEER_VIEW)],
        input=json.dumps(list(symbols)),
        capture_output=True,
        text=True,
        env={**os.environ, **host.env()},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def fake_nvidia_host(workdir: Path, devices: int = 8, optimize: str = "-O2") -> FakeNvidiaHost:
    """For a fixture: a FakeNvidiaHost with `devices` H100s in workdir (made if missing); skips the test, with the
    reason, where there is no C compiler to build the fake library."""
    import pytest  # here, so that benches use this module without pytest

    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return FakeNvidiaHost(workdir, devices=devices, optimize=optimize)
    except RuntimeError as e:
        pytest.skip(str(e))
