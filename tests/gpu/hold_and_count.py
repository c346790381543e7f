"""hold_and_count.cu's workload through a Python binding, for a machine without nvcc: cupy, else torch.

The same command line and count file as the CUDA program (its header says what they mean):
  python hold_and_count.py --binding cupy|torch --gib N --count-file FILE
  python hold_and_count.py --binding cupy|torch --alloc-only --mib M [--hold SECONDS]
The memory holds 64-bit words, word i = (i + 1) * 0x9E3779B97F4A7C15 modulo 2**64, filled and compared in chunks
(the binding's temporaries stay small beside N GiB); the counter lives in device memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

GOLDEN = 0x9E3779B97F4A7C15
CHUNK = 1 << 25  # words filled or compared at once: 256 MiB, and as much again for the temporaries


class Cupy:
    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.oom = cupy.cuda.memory.OutOfMemoryError

    def words(self, n: int):
        return self.cp.empty(n, dtype=self.cp.uint64)

    def pattern(self, start: int, end: int):
        return (self.cp.arange(start, end, dtype=self.cp.uint64) + 1) * self.cp.uint64(GOLDEN)

    def zeros(self):
        return self.cp.zeros(1, dtype=self.cp.uint64)

    def scribble(self, nbytes: int):
        buf = self.cp.empty(nbytes, dtype=self.cp.uint8)
        buf.fill(0x5A)
        self.cp.cuda.Device().synchronize()
        return buf


class Torch:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.oom = torch.cuda.OutOfMemoryError

    def words(self, n: int):
        return self.torch.empty(n, dtype=self.torch.int64, device="cuda")

    def pattern(self, start: int, end: int):
        golden = GOLDEN - (1 << 64)  # the same bits as a signed 64-bit integer: torch's arithmetic wraps alike
        return (self.torch.arange(start, end, dtype=self.torch.int64, device="cuda") + 1) * golden

    def zeros(self):
        return self.torch.zeros(1, dtype=self.torch.int64, device="cuda")

    def scribble(self, nbytes: int):
        buf = self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")
        buf.fill_(0x5A)
        self.torch.cuda.synchronize()
        return buf


def write_count(path: str, count: int, verified: int, bad: int) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(f"{count} {verified} {bad}\n")
    os.replace(f"{path}.tmp", path)


def hold(gpu, gib: float, count_file: str) -> None:
    n = int(gib * (1 << 30)) // 8
    words = gpu.words(n)
    for start in range(0, n, CHUNK):
        words[start : min(n, start + CHUNK)] = gpu.pattern(start, min(n, start + CHUNK))
    counter = gpu.zeros()
    verified = bad = 0
    tick = 0
    while True:
        counter += 1
        if tick % 10 == 0:
            for start in range(0, n, CHUNK):
                end = min(n, start + CHUNK)
                bad += int((words[start:end] != gpu.pattern(start, end)).sum().item())
            verified += 1
        write_count(count_file, int(counter[0].item()), verified, bad)
        tick += 1
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binding", choices=("cupy", "torch"), required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--mib", type=float, default=0.0)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--count-file")
    p.add_argument("--alloc-only", action="store_true")
    args = p.parse_args()
    gpu = Cupy() if args.binding == "cupy" else Torch()
    if args.alloc_only:
        try:
            buf = gpu.scribble(int(args.mib * (1 << 20)))
        except gpu.oom as e:
            print(f"hold_and_count: could not allocate {args.mib:.0f} MiB: {e}")
            return 3
        print(f"allocated {args.mib:.0f} MiB", flush=True)
        time.sleep(args.hold)
        del buf
        return 0
    if not args.count_file:
        p.error("--count-file is required")
    hold(gpu, args.gib, args.count_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
