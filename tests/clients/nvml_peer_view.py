"""What the NVML peers see: nvitop's library API and the plain pynvml bindings on the NVML library that this
process loads (tests run it with a fake host's env: LD_LIBRARY_PATH and GPUKILL_FAKE_NVML_STATE), as JSON.

A separate process because libnvidia-ml.so.1 is found through LD_LIBRARY_PATH only at start-up, and a test
process that loaded the fake would hand it to every later user of pynvml in that process. Output:
{"nvitop": [{uuid, temperature, memory: {total, used, free, reserved}, mig: [{uuid, memory: {...}}]}],
 "pynvml": {uuid: {"v1": {total, used, free}, "v2": {total, used, free, reserved} or null}},
 "processes": {uuid: [[pid, used memory or null], ...]}, "exports": {symbol: bool}}.
Values nvitop cannot read (its NA) are null. Standard input: a JSON list of symbols to look up in the library.
"""

import ctypes
import json
import sys

import pynvml
from nvitop import NA, Device


def value(v):
    return None if v is NA else v


def nvitop_memory(device) -> dict:
    info = device.memory_info()
    return {
        "total": value(info.total),
        "used": value(info.used),
        "free": value(info.free),
        "reserved": value(info.reserved),
    }


def raw_memory(handle) -> dict:
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    out = {"v1": {"total": v1.total, "used": v1.used, "free": v1.free}, "v2": None}
    try:
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2)
    except pynvml.NVMLError_NotSupported:
        return out
    out["v2"] = {"total": v2.total, "used": v2.used, "free": v2.free, "reserved": v2.reserved}
    return out


def mig_handles(handle) -> list:
    try:
        if not pynvml.nvmlDeviceGetMigMode(handle)[0]:
            return []
    except pynvml.NVMLError_NotSupported:
        return []
    found = []
    for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            found.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
        except pynvml.NVMLError_NotFound:
            continue
    return found


def main() -> None:
    symbols = json.load(sys.stdin)
    devices = Device.all()  # initialises NVML through nvitop's own wrapper around pynvml
    view = {"nvitop": [], "pynvml": {}, "processes": {}}
    for device in devices:
        view["nvitop"].append(
            {
                "uuid": device.uuid(),
                "temperature": value(device.temperature()),
                "memory": nvitop_memory(device),
                "mig": [{"uuid": mig.uuid(), "memory": nvitop_memory(mig)} for mig in device.mig_devices()],
            }
        )
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        for h in [handle, *mig_handles(handle)]:
            uuid = pynvml.nvmlDeviceGetUUID(h)
            view["pynvml"][uuid] = raw_memory(h)
            view["processes"][uuid] = [[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
    library = ctypes.CDLL("libnvidia-ml.so.1")  # the copy already loaded: dlopen finds it by its soname
    view["exports"] = {name: hasattr(library, name) for name in symbols}
    json.dump(view, sys.stdout)


if __name__ == "__main__":
    main()
