"""Fixture hosts for the DRM backend: sysfs, /proc, debugfs and /dev/dri trees in the kernel's own formats.

Everything the backend reads is written here the way the kernel writes it: sysfs attributes with their trailing
newline and symlinks laid out as in /sys/devices (class/drm/cardN -> ../../devices/.../drm/cardN, device ->
../../../ADDR, driver -> bus/pci/drivers/NAME); DRM device nodes are real character devices 226:N (made with
mknod, hence root); /proc/PID/fd/N are symlinks to them, and /proc/PID/fdinfo/N holds the generic lines of
fs/proc/fd.c ("pos:\\t0", "flags:\\t0...", "mnt_id:", "ino:" = the node's inode) followed by what drm_show_fdinfo
and each driver print (amdgpu_fdinfo.c, i915_drm_client.c, xe_drm_client.c, panfrost.rst, msm_gpu.c; memory
through drm_print_memory_stats' units). A process is either made up (stat and status in the kernel's format)
or mirrors a real one: its stat, status, cmdline, cgroup and environ are symlinks into the real /proc, so
start times are real and a kill reaches a real process.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path


def print_size(kind: str, region: str, size: int) -> str:
    """drm_print_memory_stats: bytes, or KiB/MiB while the value divides evenly (drm_file.c print_size)."""
    units = ["", " KiB", " MiB"]
    u = 0
    while u < len(units) - 1 and size != 0 and size % 1024 == 0:
        size //= 1024
        u += 1
    return f"drm-{kind}-{region}:\t{size}{units[u]}\n"


def memory_stats(
    region: str, total: int, resident: int, shared: int = 0, active: int = 0, purgeable: int | None = 0
) -> str:
    text = print_size("total", region, total) + print_size("shared", region, shared)
    text += print_size("active", region, active) + print_size("resident", region, resident)
    if purgeable is not None:
        text += print_size("purgeable", region, purgeable)
    return text


def drm_header(driver: str, client_id: int, pdev: str | None) -> str:
    """drm_show_fdinfo: the lines the DRM core prints before the driver's own."""
    text = f"drm-driver:\t{driver}\ndrm-client-id:\t{client_id}\n"
    return text + (f"drm-pdev:\t{pdev}\n" if pdev else "")


def amdgpu_fdinfo(
    client_id: int,
    pdev: str,
    *,
    vram: int = 0,
    gtt: int = 0,
    cpu: int = 0,
    vram_resident: int | None = None,
    gfx_ns: int = 0,
    compute_ns: int = 0,
    dma_ns: int = 0,
    pasid: int = 32770,
) -> str:
    """amdgpu_show_fdinfo (6.11+): drm_print_memory_stats per placement, the legacy drm-memory-* aliases (note
    the space before the tab, as amdgpu prints it), amd-* keys, and drm-engine-* only for engines used."""
    resident = vram if vram_resident is None else vram_resident
    text = drm_header("amdgpu", client_id, pdev) + f"pasid:\t{pasid}\n"
    text += memory_stats("cpu", cpu, cpu) + memory_stats("gtt", gtt, gtt) + memory_stats("vram", vram, resident)
    text += f"drm-memory-vram:\t{resident // 1024} KiB\ndrm-memory-gtt: \t{gtt // 1024} KiB\n"
    text += f"drm-memory-cpu: \t{cpu // 1024} KiB\n"
    text += (
        f"amd-evicted-vram:\t0 KiB\namd-requested-vram:\t{vram // 1024} KiB\namd-requested-gtt:\t{gtt // 1024} KiB\n"
    )
    for name, ns in (("gfx", gfx_ns), ("compute", compute_ns), ("dma", dma_ns)):
        if ns:
            text += f"drm-engine-{name}:\t{ns} ns\n"
    return text


def amdgpu_fdinfo_legacy(client_id: int, pdev: str, *, vram: int, gtt: int, gfx_ns: int) -> str:
    """amdgpu before 6.11 (amdgpu_fdinfo.c printing the whole record itself): drm-memory-* only."""
    return (
        f"pasid:\t32769\ndrm-driver:\tamdgpu\ndrm-pdev:\t{pdev}\ndrm-client-id:\t{client_id}\n"
        f"drm-memory-vram:\t{vram // 1024} KiB\ndrm-memory-gtt: \t{gtt // 1024} KiB\ndrm-memory-cpu: \t0 KiB\n"
        f"amd-memory-visible-vram:\t0 KiB\namd-evicted-vram:\t0 KiB\namd-evicted-visible-vram:\t0 KiB\n"
        f"amd-requested-vram:\t{vram // 1024} KiB\namd-requested-visible-vram:\t0 KiB\n"
        f"amd-requested-gtt:\t{gtt // 1024} KiB\ndrm-engine-gfx:\t{gfx_ns} ns\n"
    )


def i915_fdinfo(
    client_id: int,
    pdev: str,
    *,
    render_ns: int,
    copy_ns: int = 0,
    video_ns: int = 0,
    enhance_ns: int = 0,
    system0: int = 0,
    local0: int | None = None,
) -> str:
    """i915_drm_client_fdinfo: memory per region (system0, local0 on discrete cards, stolen-*), then engines;
    drm-engine-capacity-video because this part has two video engines."""
    text = drm_header("i915", client_id, pdev)
    text += memory_stats("system0", system0, system0)
    if local0 is not None:
        text += memory_stats("local0", local0, local0)
    text += memory_stats("stolen-system0", 0, 0)
    text += (
        f"drm-engine-render:\t{render_ns} ns\ndrm-engine-copy:\t{copy_ns} ns\ndrm-engine-video:\t{video_ns} ns\n"
        f"drm-engine-capacity-video:\t2\ndrm-engine-video-enhance:\t{enhance_ns} ns\n"
    )
    return text


def xe_fdinfo(client_id: int, pdev: str, *, rcs: int, ccs: int, total_cycles: int, vram0: int = 0, gtt: int = 0) -> str:
    """xe_drm_client_fdinfo: memory regions (purgeable for system only), then per engine class the busy and
    total GPU timestamp cycles, with drm-engine-capacity-<class> where the class has more than one engine."""
    text = drm_header("xe", client_id, pdev)
    text += memory_stats("system", 0, 0) + memory_stats("gtt", gtt, gtt, purgeable=None)
    text += memory_stats("vram0", vram0, vram0, purgeable=None) + memory_stats("stolen", 0, 0, purgeable=None)
    for cls, cycles, capacity in (("rcs", rcs, 1), ("bcs", 0, 1), ("vcs", 0, 2), ("vecs", 0, 2), ("ccs", ccs, 4)):
        text += f"drm-cycles-{cls}:\t{cycles}\ndrm-total-cycles-{cls}:\t{total_cycles}\n"
        if capacity > 1:
            text += f"drm-engine-capacity-{cls}:\t{capacity}\n"
    return text


def panfrost_fdinfo(
    client_id: int,
    *,
    fragment_ns: int,
    fragment_cycles: int,
    vertex_ns: int,
    vertex_cycles: int,
    maxfreq_hz: int = 799999987,
    total: int = 0,
    resident: int = 0,
) -> str:
    """Documentation/gpu/panfrost.rst: ns, cycles, maxfreq and curfreq per engine, memory in region "memory";
    a platform device, so no drm-pdev."""
    text = drm_header("panfrost", client_id, None)
    for name, ns, cycles in (("fragment", fragment_ns, fragment_cycles), ("vertex-tiler", vertex_ns, vertex_cycles)):
        text += (
            f"drm-engine-{name}:\t{ns} ns\ndrm-cycles-{name}:\t{cycles}\ndrm-maxfreq-{name}:\t{maxfreq_hz} Hz\n"
            f"drm-curfreq-{name}:\t{maxfreq_hz} Hz\n"
        )
    return text + memory_stats("memory", total, resident)


def msm_fdinfo(
    client_id: int, *, elapsed_ns: int, cycles: int, maxfreq_hz: int, total: int = 0, resident: int = 0
) -> str:
    """msm_gpu_show_fdinfo after drm_show_fdinfo; memory from drm_show_memory_stats (region "memory")."""
    text = drm_header("msm", client_id, None)
    text += f"drm-engine-gpu:\t{elapsed_ns} ns\ndrm-cycles-gpu:\t{cycles}\ndrm-maxfreq-gpu:\t{maxfreq_hz} Hz\n"
    return text + memory_stats("memory", total, resident)


def stat_line(pid: int, comm: str, start_time: int, ppid: int = 1, flags: int = 4194304) -> str:
    """/proc/PID/stat as fs/proc/array.c prints it (52 fields)."""
    return (
        f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 {flags} 2048 0 0 0 12 4 0 0 20 0 1 0 {start_time} "
        "10485760 2560 18446744073709551615 94000000000000 94000000020000 140700000000000 0 0 0 0 0 0 0 0 0 17 "
        "1 0 0 0 0 0 94000000030000 94000000031000 94000010000000 140700000001000 140700000001020 "
        "140700000001020 140700000002000 0\n"
    )


def clients_header(name_column: bool = True) -> str:
    """drm_debugfs.c drm_clients_info's header; kernels before 6.14 have no "name" column."""
    text = f"{'command':>20} {'tgid':>5} {'dev':>3} master a {'uid':>5} {'magic':>10}"
    return text + (f" {'name':>{CLIENT_NAME_WIDTH}}\n" if name_column else "\n")


def clients_row(
    comm: str, tgid: int, minor: int, uid: int, master: bool = False, name: str | None = None, name_column: bool = True
) -> str:
    """One drm_file as drm_clients_info prints it: "%20s %5d %3d   %c    %c %5d %10u %*s"."""
    text = f"{comm:>20} {tgid:>5} {minor:>3}   {'y' if master else 'n'}    y {uid:>5} {0:>10}"
    return text + (f" {name or '<unset>':>{CLIENT_NAME_WIDTH}}\n" if name_column else "\n")


CLIENT_NAME_WIDTH = 64  # DRM_CLIENT_NAME_MAX_LEN


class DrmHost:
    """One fixture host under `root`: sys/, proc/, debug/ and dev/ trees. With debugfs_clients, every card also
    gets debugfs dri/<card minor>/clients, kept in step with open_drm, close_fd and exit as the kernel keeps it."""

    def __init__(self, root: Path | str, debugfs_clients: bool = False) -> None:
        self.root = Path(root)
        self.sys = self.root / "sys"
        self.proc = self.root / "proc"
        self.debugfs = self.root / "debug"
        self.dev = self.root / "dev"
        for d in (self.sys / "class" / "drm", self.proc, self.debugfs / "dri", self.dev / "dri"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.nodes: dict[int, Path] = {}
        self.debugfs_clients = debugfs_clients
        self.card_of: dict[int, int] = {}  # card or render minor -> the card's minor, whose clients file lists it
        self.listed: dict[int, list[tuple[int, int, int]]] = {}  # card minor -> (pid, fd, minor) rows
        self.uids: dict[int, int] = {}

    # -- sysfs -----------------------------------------------------------------------------------------

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def _node(self, minor: int, name: str) -> None:
        path = self.dev / "dri" / name
        if not path.exists():
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(226, minor))
        self.nodes[minor] = path

    def _drm_device(self, device: Path, bus: str, driver: str, card: int, render: int | None) -> Path:
        """The drm/ children of a device and their class links, as drm_sysfs.c registers them."""
        drivers = self.sys / "bus" / bus / "drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        (device / "driver").symlink_to(os.path.relpath(drivers, device))
        (device / "subsystem").symlink_to(os.path.relpath(self.sys / "bus" / bus, device))
        for name, minor in ((f"card{card}", card), (f"renderD{render}", render)):
            if minor is None:
                continue
            node_dir = device / "drm" / name
            self._write(node_dir / "dev", f"226:{minor}\n")
            (node_dir / "device").symlink_to(f"../../../{device.name}")
            (node_dir / "subsystem").symlink_to(os.path.relpath(self.sys / "class" / "drm", node_dir))
            (self.sys / "class" / "drm" / name).symlink_to(os.path.relpath(node_dir, self.sys / "class" / "drm"))
            self._node(minor, name)
            self.card_of[minor] = card
        if self.debugfs_clients:
            self.listed.setdefault(card, [])
            self.write_clients(card)
        return device

    # -- debugfs client lists --------------------------------------------------------------------------

    def write_clients(self, card: int, text: str | None = None) -> Path:
        """dri/<card>/clients: the rows of the fds open on the card, or `text` as given (a hostile file)."""
        path = self.debugfs / "dri" / str(card) / "clients"
        if text is None:
            rows = []
            for pid, _fd, minor in reversed(self.listed.get(card, [])):  # the kernel walks its list backwards
                comm_path = self.proc / str(pid) / "comm"
                comm = comm_path.read_text().strip() if comm_path.exists() else "<unknown>"
                rows.append(clients_row(comm, pid, minor, self.uids.get(pid, 0)))
            text = clients_header() + "".join(rows)
        self._write(path, text)
        return path

    def pci_device(
        self,
        address: str,
        vendor: int,
        device_id: int,
        driver: str,
        card: int,
        render: int | None,
        files: dict[str, str] | None = None,
    ) -> Path:
        device = self.sys / "devices" / f"pci{address[:4]}:00" / address
        device.mkdir(parents=True)
        self._write(device / "vendor", f"0x{vendor:04x}\n")
        self._write(device / "device", f"0x{device_id:04x}\n")
        self._write(device / "class", "0x030000\n")
        for name, text in (files or {}).items():
            self._write(device / name, text)
        link = self.sys / "bus" / "pci" / "devices" / address
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(device, link.parent))
        return self._drm_device(device, "pci", driver, card, render)

    def platform_device(
        self,
        name: str,
        driver: str,
        card: int,
        render: int | None,
        compatible: list[str],
        files: dict[str, str] | None = None,
    ) -> Path:
        device = self.sys / "devices" / "platform" / name
        device.mkdir(parents=True)
        (device / "of_node").mkdir()
        (device / "of_node" / "compatible").write_bytes(b"".join(c.encode() + b"\0" for c in compatible))
        for fname, text in (files or {}).items():
            self._write(device / fname, text)
        return self._drm_device(device, "platform", driver, card, render)

    def hwmon(self, device: Path, name: str, attrs: dict[str, str | int], index: int = 0) -> Path:
        hw = device / "hwmon" / f"hwmon{index}"
        self._write(hw / "name", f"{name}\n")
        for attr, value in attrs.items():
            self._write(hw / attr, f"{value}\n")
        return hw

    def amdgpu(
        self,
        address: str = "0000:03:00.0",
        card: int = 0,
        render: int = 128,
        *,
        busy: int = 0,
        vram_used: int = 0,
        vram_total: int = 24 << 30,
        edge_mc: int = 45000,
        junction_mc: int = 52000,
        power_uw: int | None = 98_000_000,
        sclk_hz: int = 2_100_000_000,
        unique_id: str | None = None,
        device_id: int = 0x744C,
        product_name: str = "",
    ) -> Path:
        files = {
            "gpu_busy_percent": f"{busy}\n",
            "mem_info_vram_used": f"{vram_used}\n",
            "mem_info_vram_total": f"{vram_total}\n",
            "product_name": f"{product_name}\n",
            "reset_method": "flr bus\n",
            "reset": "",
        }
        if unique_id is not None:
            files["unique_id"] = f"{unique_id}\n"
        dev = self.pci_device(address, 0x1002, device_id, "amdgpu", card, render, files)
        attrs: dict[str, str | int] = {
            "temp1_input": edge_mc,
            "temp1_label": "edge",
            "temp2_input": junction_mc,
            "temp2_label": "junction",
            "freq1_input": sclk_hz,
            "freq1_label": "sclk",
        }
        if power_uw is not None:
            attrs["power1_average"] = power_uw
        self.hwmon(dev, "amdgpu", attrs)
        return dev

    def i915(
        self,
        address: str = "0000:00:02.0",
        card: int = 1,
        render: int = 129,
        *,
        act_freq_mhz: int = 1300,
        energy_uj: int | None = None,
        device_id: int = 0x56A0,
        reset_method: str = "flr bus\n",
    ) -> Path:
        dev = self.pci_device(
            address, 0x8086, device_id, "i915", card, render, {"reset_method": reset_method, "reset": ""}
        )
        self._write(dev / "drm" / f"card{card}" / "gt_act_freq_mhz", f"{act_freq_mhz}\n")
        if energy_uj is not None:  # discrete cards only; i915's hwmon has no temperature
            self.hwmon(dev, "i915", {"energy1_input": energy_uj, "power1_max": 190_000_000})
        return dev

    def xe(
        self,
        address: str = "0000:04:00.0",
        card: int = 2,
        render: int = 130,
        *,
        act_freq_mhz: int = 2000,
        pkg_mc: int = 48000,
        energy_uj: int = 0,
    ) -> Path:
        dev = self.pci_device(address, 0x8086, 0xE20B, "xe", card, render, {"reset_method": "flr\n", "reset": ""})
        self._write(dev / "tile0" / "gt0" / "freq0" / "act_freq", f"{act_freq_mhz}\n")
        self.hwmon(dev, "xe", {"temp2_input": pkg_mc, "temp2_label": "pkg", "energy1_input": energy_uj})
        return dev

    def panfrost(
        self, name: str = "fde60000.gpu", card: int = 0, render: int = 128, *, cur_freq_hz: int = 800_000_000
    ) -> Path:
        return self.platform_device(
            name,
            "panfrost",
            card,
            render,
            ["rockchip,rk3568-mali", "arm,mali-bifrost"],
            {f"devfreq/{name}/cur_freq": f"{cur_freq_hz}\n"},
        )

    def asahi(self, name: str = "206400000.gpu", card: int = 1, render: int = 128) -> Path:
        return self.platform_device(name, "asahi", card, render, ["apple,agx-t8103", "apple,agx-g13g"])

    def ast(self, address: str = "0000:02:00.0", card: int = 9) -> Path:
        """A server's BMC display: a DRM card with no render node, which is nobody's GPU."""
        return self.pci_device(address, 0x1A03, 0x2000, "ast", card, None)

    def set_attr(self, device: Path, name: str, value: str | int) -> None:
        self._write(device / name, f"{value}\n")

    def xgmi_hive(self, devices: list[Path], hive_id: int) -> None:
        """amdgpu_xgmi_sysfs_add_dev_info: the first member holds xgmi_hive_info/ (xgmi_hive_id, nodeN links to
        every member); the others link to it; each has xgmi_device_id."""
        hive = devices[0] / "xgmi_hive_info"
        self._write(hive / "xgmi_hive_id", f"{hive_id}\n")
        for n, dev in enumerate(devices, 1):
            self._write(dev / "xgmi_device_id", f"{hive_id + n}\n")
            (hive / f"node{n}").symlink_to(os.path.relpath(dev, hive))
            if n > 1:
                (dev / "xgmi_hive_info").symlink_to(os.path.relpath(hive, dev))

    def amdgpu_recover(self, card: int, answer: str | None = "0\n", fifo: bool = False) -> Path:
        """debugfs dri/<minor>/amdgpu_gpu_recover: a FIFO lets a test see the read and answer it."""
        path = self.debugfs / "dri" / str(card) / "amdgpu_gpu_recover"
        path.parent.mkdir(parents=True, exist_ok=True)
        if fifo:
            os.mkfifo(path)
        else:
            path.write_text(answer or "")
        return path

    # -- KFD -------------------------------------------------------------------------------------------

    def kfd_gpu(self, node: int, gpu_id: int, render_minor: int, simd_count: int = 416, simd_per_cu: int = 4) -> None:
        """kfd/topology/nodes/N: gpu_id and the properties lines of kfd_topology.c node_show."""
        base = self.sys / "class" / "kfd" / "kfd" / "topology" / "nodes"
        if not (base / "0").exists():
            self._write(base / "0" / "gpu_id", "0\n")
            self._write(base / "0" / "properties", "cpu_cores_count 64\nsimd_count 0\nmem_banks_count 1\n")
        props = (
            f"cpu_cores_count 0\nsimd_count {simd_count}\nmem_banks_count 1\ncaches_count 262\nio_links_count 1\n"
            f"p2p_links_count 0\ncpu_core_id_base 0\nsimd_id_base 2147487744\nmax_waves_per_simd 8\n"
            f"lds_size_in_kb 64\ngds_size_in_kb 0\nnum_gws 64\nwave_front_size 64\narray_count 8\n"
            f"simd_arrays_per_engine 1\ncu_per_simd_array 13\nsimd_per_cu {simd_per_cu}\n"
            f"max_slots_scratch_cu 32\ngfx_target_version 90010\nvendor_id 4098\ndevice_id 29711\n"
            f"location_id 768\ndomain 0\ndrm_render_minor {render_minor}\nhive_id 0\nnum_sdma_engines 2\n"
            f"num_sdma_xgmi_engines 6\nnum_sdma_queues_per_engine 8\nnum_cp_queues 24\nmax_engine_clk_fcompute 1700\n"
            f"local_mem_size 0\nfw_version 78\ncapability 746586752\ndebug_prop 1495\nsdma_fw_version 9\n"
            f"unique_id 12345678901234567890\nnum_xcc 1\nmax_engine_clk_ccompute 3100\n"
        )
        self._write(base / str(node) / "gpu_id", f"{gpu_id}\n")
        self._write(base / str(node) / "properties", props)

    def kfd_process(
        self, pid: int, gpu_id: int, vram: int, sdma_us: int = 0, cu_occupancy: int = 0, pasid: int = 32771
    ) -> None:
        base = self.sys / "class" / "kfd" / "kfd" / "proc" / str(pid)
        self._write(base / "pasid", f"{pasid}\n")
        self._write(base / f"vram_{gpu_id}", f"{vram}\n")
        self._write(base / f"sdma_{gpu_id}", f"{sdma_us}\n")
        self._write(base / f"stats_{gpu_id}" / "evicted_ms", "0\n")
        self._write(base / f"stats_{gpu_id}" / "cu_occupancy", f"{cu_occupancy}\n")
        (base / "queues").mkdir(exist_ok=True)

    # -- /proc -----------------------------------------------------------------------------------------

    def process(self, pid: int, comm: str = "worker", start_time: int = 100_000, uid: int = 1000) -> Path:
        """A made-up process: stat, status and cmdline in the kernel's formats, an empty fd table."""
        p = self.proc / str(pid)
        (p / "fd").mkdir(parents=True)
        (p / "fdinfo").mkdir()
        (p / "stat").write_text(stat_line(pid, comm, start_time))
        (p / "status").write_text(
            f"Name:\t{comm}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nNgid:\t0\n"
            f"Pid:\t{pid}\nPPid:\t1\nTracerPid:\t0\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
            f"Gid:\t{uid}\t{uid}\t{uid}\t{uid}\nFDSize:\t64\nGroups:\t{uid}\nNSpid:\t{pid}\n"
        )
        (p / "cmdline").write_bytes(comm.encode() + b"\0")
        (p / "comm").write_text(f"{comm[:15]}\n")
        self.uids[pid] = uid
        (p / "cgroup").write_text("0::/user.slice/user-1000.slice/session-2.scope\n")
        return p

    def mirror(self, pid: int) -> Path:
        """A real process seen through the fixture /proc: its own stat, status, cmdline, cgroup and environ
        (links into /proc/PID, so every value is the kernel's and current), fd and fdinfo of the fixture's."""
        p = self.proc / str(pid)
        (p / "fd").mkdir(parents=True)
        (p / "fdinfo").mkdir()
        for name in ("stat", "status", "cmdline", "cgroup", "environ", "comm"):
            (p / name).symlink_to(f"/proc/{pid}/{name}")
        (p / "exe").symlink_to(os.readlink(f"/proc/{pid}/exe"))
        return p

    def fdinfo_prefix(self, minor: int, flags: str = "02100002") -> str:
        """fs/proc/fd.c seq_show: the lines every fdinfo starts with; ino is the device node's inode."""
        return f"pos:\t0\nflags:\t{flags}\nmnt_id:\t24\nino:\t{os.stat(self.nodes[minor]).st_ino}\n"

    def open_drm(self, pid: int, fd: int, minor: int, drm_text: str = "", listed: bool = True) -> None:
        """listed=False: the fd is not in the card's clients list under this pid (inherited, or passed over a
        unix socket: the kernel lists the tgid that opened the file)."""
        p = self.proc / str(pid)
        (p / "fd" / str(fd)).symlink_to(self.nodes[minor])
        (p / "fdinfo" / str(fd)).write_text(self.fdinfo_prefix(minor) + drm_text)
        if self.debugfs_clients and listed:
            card = self.card_of[minor]
            self.listed.setdefault(card, []).append((pid, fd, minor))
            self.write_clients(card)

    def _unlist(self, match) -> None:
        for card, rows in self.listed.items():
            kept = [r for r in rows if not match(r)]
            if len(kept) != len(rows):
                self.listed[card] = kept
                self.write_clients(card)

    def set_fdinfo(self, pid: int, fd: int, minor: int, drm_text: str) -> None:
        path = self.proc / str(pid) / "fdinfo" / str(fd)
        tmp = path.with_suffix(".new")
        tmp.write_text(self.fdinfo_prefix(minor) + drm_text)
        os.replace(tmp, path)  # the reader never sees half a file

    def open_file(self, pid: int, fd: int, target: str) -> None:
        """A non-DRM fd: /dev/null, a regular file, or "socket:[N]" (dangling here, as stat-able only in /proc)."""
        p = self.proc / str(pid)
        (p / "fd" / str(fd)).symlink_to(target)
        (p / "fdinfo" / str(fd)).write_text("pos:\t0\nflags:\t02\nmnt_id:\t23\nino:\t4242\n")

    def close_fd(self, pid: int, fd: int) -> None:
        p = self.proc / str(pid)
        (p / "fd" / str(fd)).unlink()
        (p / "fdinfo" / str(fd)).unlink()
        if self.debugfs_clients:
            self._unlist(lambda r: r[:2] == (pid, fd))

    def exit(self, pid: int) -> None:
        shutil.rmtree(self.proc / str(pid))
        if self.debugfs_clients:
            self._unlist(lambda r: r[0] == pid)

    def config(self, path: Path, backends: str = "drm", interval: float = 0.2) -> Path:
        path.write_text(
            f"[daemon]\nbackends = {backends}\nsample_interval = {interval}\n"
            f"[paths]\nproc = {self.proc}\nsys = {self.sys}\ndebugfs = {self.debugfs}\n"
        )
        return path
