"""`make test-package`: the Kubernetes image (deploy/container/Containerfile) built for real without a registry,
and run the way deploy/kubernetes/daemonset.yaml runs it.

The base image is a debootstrapped bookworm (minbase) committed with buildah, cached as the tree in
$GPUKILL_NSPAWN_CACHE/image-root and as the local image below; the Containerfile is built on it with
`buildah bud --build-arg BASE=...` (its RUN steps reach Debian's archive and PyPI, as any build of it does).
Then podman runs the image's entrypoint as the DaemonSet's gpukilld container runs it: the node's PID namespace
(--pid=host), privileged, the ConfigMap at /etc/gpukill read-only, /run/dbus as the pod's emptyDir, the state
hostPath, /dev and /sys; `podman exec ... gpukillctl` reaches the daemon on the pod's bus, as `kubectl exec`
does, and the exporter container runs as its own uid on the same bus. The NVML hostPath is left out: this
machine has no NVIDIA driver (the daemon runs on simulated GPUs, a file added to the ConfigMap's tree).
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUKILL_NSPAWN_CACHE", "/var/cache/gpukill-test"))
MIRROR = os.environ.get("GPUKILL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_IMAGE = "localhost/gpukill-test-base:bookworm"
IMAGE = "localhost/gpukill-test:latest"
KUBE = REPO / "deploy" / "kubernetes"
# a scope of its own (GPUKILL_SIM_SCOPE): the pod's daemon counts only this test's victims, never those of
# other test runs on the machine, which the ConfigMap's Guard rule could otherwise act on
SCOPE = f"image-test-{os.getpid()}"

# These machines mount cgroups in hybrid mode (v1 controllers beside an empty v2 tree), where crun (podman's
# default runtime in bookworm) refuses every container ("cgroups in hybrid mode not supported"); runc runs them.
# Root here lacks CAP_SYS_RESOURCE, so a container's open-files limit cannot exceed ours: podman's default
# (1048576) fails with "error setting rlimit type 7", so the limits asked are the ones we have.
RUNTIME = ["--runtime", "runc"]
NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
NPROC = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
ULIMITS = [f"--ulimit=nofile={NOFILE}:{NOFILE}", f"--ulimit=nproc={NPROC}:{NPROC}"]

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(t) for t in ("buildah", "podman", "runc", "debootstrap")),
        reason="needs root, buildah, podman, runc and debootstrap (make pkg-deps installs them)",
    ),
    # the first build debootstraps the base and fetches from Debian's archive and PyPI: minutes, not seconds
    pytest.mark.timeout(1800),
]


def sh(*argv: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def pip_ca() -> list[str]:
    """The build's pip trusts the CA bundle this machine's pip is told to (/etc/pip.conf's cert: a proxy's).
    The bundle is not in the image; only the empty file buildah mounted it on stays, in this test's build."""
    config = configparser.ConfigParser()
    config.read("/etc/pip.conf")
    cert = config.get("global", "cert", fallback=None)
    if not cert or not os.path.isfile(cert):
        return []
    return ["-v", f"{cert}:/run/gpukill-build-ca.crt:ro", "--build-arg", "PIP_CERT=/run/gpukill-build-ca.crt"]


def base_image() -> str:
    """A bookworm image made from a debootstrapped tree (no registry): built once, then reused."""
    if sh("buildah", "inspect", "--type", "image", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    root = CACHE / "image-root"
    if not (root / ".gpukill-complete").exists():
        fresh = CACHE / "image-root.new"
        shutil.rmtree(fresh, ignore_errors=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        sh("debootstrap", "--variant=minbase", "bookworm", str(fresh), MIRROR, timeout=900)
        (fresh / ".gpukill-complete").touch()
        shutil.rmtree(root, ignore_errors=True)
        fresh.rename(root)
    container = sh("buildah", "from", "scratch").stdout.strip()
    try:
        mounted = sh("buildah", "mount", container).stdout.strip()
        sh("cp", "-a", f"{root}/.", mounted)
        os.unlink(Path(mounted) / ".gpukill-complete")
        sh("buildah", "umount", container)
        sh("buildah", "commit", "--rm", container, BASE_IMAGE, timeout=600)
    except BaseException:
        sh("buildah", "rm", container, check=False)
        raise
    return BASE_IMAGE


def daemonset() -> dict:
    (doc,) = [d for d in yaml.safe_load_all((KUBE / "daemonset.yaml").read_text()) if d and d["kind"] == "DaemonSet"]
    return doc


def configmap_tree(dest: Path) -> None:
    """The files the kubelet makes of the ConfigMap volume (its items: key -> path)."""
    (cm,) = [d for d in yaml.safe_load_all((KUBE / "configmap.yaml").read_text()) if d and d["kind"] == "ConfigMap"]
    (volume,) = [v for v in daemonset()["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    for item in volume["configMap"]["items"]:
        (dest / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (dest / item["path"]).write_text(cm["data"][item["key"]])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.5)
    return None


def scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


@pytest.fixture(scope="module")
def image():
    t0 = time.monotonic()
    base = base_image()
    before = sh("podman", "image", "inspect", "-f", "{{.Id}}", IMAGE, check=False).stdout.strip()
    r = sh(
        "buildah",
        "bud",
        *RUNTIME,
        *ULIMITS,
        "--layers",
        "--network=host",
        *pip_ca(),
        "--build-arg",
        f"BASE={base}",
        "-f",
        str(REPO / "deploy/container/Containerfile"),
        "-t",
        IMAGE,
        str(REPO),
        timeout=1500,
        check=False,
    )
    assert r.returncode == 0, f"buildah bud failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    print(f"\nimage built in {time.monotonic() - t0:.0f}s")
    if before and before != sh("podman", "image", "inspect", "-f", "{{.Id}}", IMAGE).stdout.strip():
        sh("podman", "rmi", before, check=False)  # the previous run's image, untagged by this build: not kept
    return IMAGE


def test_the_image_runs_gpukilld_as_the_daemonset_does(image, tmp_path):
    spec = daemonset()["spec"]["template"]["spec"]
    (pod,) = [c for c in spec["containers"] if c["name"] == "gpukilld"]
    (exporter,) = [c for c in spec["containers"] if c["name"] == "exporter"]
    assert spec["hostPID"] is True and pod["securityContext"]["privileged"] is True
    mounts = {m["name"]: m["mountPath"] for m in pod["volumeMounts"]}
    configmap, state, bus = tmp_path / "configmap", tmp_path / "state", tmp_path / "bus"
    for d in (configmap, state, bus):
        d.mkdir()
    programs = Path(tempfile.mkdtemp(prefix="gpukill-image-test-"))  # one that nobody may execute from
    programs.chmod(0o755)
    configmap_tree(configmap)
    sim = yaml.safe_load((REPO / "examples/simulate.yaml").read_text())
    sim["scope"] = SCOPE
    (configmap / "simulate.yaml").write_text(yaml.safe_dump(sim))
    name = f"gpukill-image-test-{os.getpid()}"
    run = [
        "podman",
        *RUNTIME,
        "run",
        *ULIMITS,
        "-d",
        "--name",
        name,
        "--pid=host",
        "--privileged",
        "--user",
        "0",
        "-v",
        f"{configmap}:{mounts['config']}:ro",
        "-v",
        f"{bus}:{mounts['bus']}",
        "-v",
        f"{state}:{mounts['state']}",
        "-v",
        f"/dev:{mounts['dev']}",
        "-v",
        f"/sys:{mounts['sys']}:ro",
        *[f"--env={e['name']}={e['value']}" for e in pod.get("env", [])],
        image,
        *pod["args"],
        "--simulate",
        f"{mounts['config']}/simulate.yaml",
    ]
    started = sh(*run, check=False)
    if started.returncode != 0 and re.search(
        r"operation not permitted|permission denied|not supported", started.stderr, re.I
    ):
        pytest.skip(f"podman cannot run a container on this kernel: {started.stderr.strip()[-400:]}")
    assert started.returncode == 0, started
    victim = exported = None
    try:

        def kubectl_exec(*args: str) -> subprocess.CompletedProcess:
            return sh("podman", "exec", name, "gpukillctl", *args, check=False, timeout=60)

        up = wait_until(
            lambda: (
                kubectl_exec("status").returncode == 0
                or sh("podman", "inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true"
            ),
            90,
        )
        logs = sh("podman", "logs", name, check=False)
        assert up and kubectl_exec("status").returncode == 0, logs.stdout + logs.stderr
        assert "gpukilld 0.1.0" in kubectl_exec("status").stdout
        # the pod's bus is the pod's: its socket in the emptyDir, its config nowhere on the host
        assert (bus / "system_bus_socket").is_socket() and not Path("/run/dbus/pod-bus.conf").exists()
        # a GPU process of the node (hostPID), seen by the daemon in the image
        victim = subprocess.Popen(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sleep", "300"],
            env={
                "PATH": "/usr/bin:/bin",
                "GPUKILL_SIM_GPU": "1",
                "GPUKILL_SIM_MEM": "2GiB",
                "GPUKILL_SIM_SCOPE": SCOPE,
            },
        )
        listed = wait_until(
            lambda: (
                (r := kubectl_exec("list", "--json")).returncode == 0
                and victim.pid in {p["pid"] for p in json.loads(r.stdout)["processes"]}
                and r
            ),
            60,
        )
        assert listed, kubectl_exec("list").stdout
        devices = json.loads(listed.stdout)["devices"]
        assert [d["name"] for d in devices] == [d["name"] for d in sim["devices"]]
        status = json.loads(kubectl_exec("guard", "status", "--json").stdout)
        assert [r["name"] for r in status["rules"]] == ["block-crypto-miners"], status  # the ConfigMap's policy
        # ... in force on the node's processes: one named like a miner is stopped, the other process stays
        shutil.copy("/bin/sleep", programs / "xmrig")
        miner = subprocess.Popen(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", str(programs / "xmrig"), "300"],
            env={
                "PATH": "/usr/bin:/bin",
                "GPUKILL_SIM_GPU": "0",
                "GPUKILL_SIM_MEM": "1GiB",
                "GPUKILL_SIM_SCOPE": SCOPE,
            },
        )
        try:
            miner.wait(timeout=90)
        except subprocess.TimeoutExpired:
            miner.kill()
            miner.wait()
        logs = sh("podman", "logs", name, check=False)
        # killed by a signal (SIGTERM, or SIGKILL after the grace), not exited on its own
        assert miner.returncode in (-15, -9), (miner.returncode, logs.stdout[-2000:], logs.stderr[-2000:])
        assert "block-crypto-miners" in logs.stdout + logs.stderr  # the audit, in `kubectl logs`
        assert victim.poll() is None

        # the exporter container: its command and user, the same bus read-only (here on the host's network, on a
        # free port: a pod's containers share one network namespace)
        port = free_port()
        command = [str(port) if a == str(exporter["ports"][0]["containerPort"]) else a for a in exporter["command"]]
        command = ["127.0.0.1" if a == "0.0.0.0" else a for a in command]
        ctx = exporter["securityContext"]
        exported = f"{name}-exporter"
        sh(
            "podman",
            *RUNTIME,
            "run",
            *ULIMITS,
            "-d",
            "--name",
            exported,
            "--pid=host",
            "--network=host",
            "--read-only",
            "--cap-drop=all",
            f"--user={ctx['runAsUser']}:{ctx['runAsGroup']}",
            "-v",
            f"{bus}:{mounts['bus']}:ro",
            "--entrypoint",
            command[0],
            image,
            *command[1:],
        )
        url = f"http://127.0.0.1:{port}/metrics"
        metrics = wait_until(lambda: (m := scrape(url)) and "\ngpukill_up 1" in m and m, 90)
        assert metrics, sh("podman", "logs", exported, check=False).stderr
        assert metrics.count("\ngpukill_device_up{") == len(sim["devices"])
        # nobody's memory: the victim's 2 GiB alone, once the sample after the miner's end is the one read
        nobody = re.compile(r'^gpukill_user_gpu_memory_bytes\{user="nobody"\} 2\.147483648e\+09$', re.M)
        assert wait_until(lambda: (m := scrape(url)) and nobody.search(m), 60), scrape(url)
    finally:
        if victim is not None:
            victim.kill()
            victim.wait()
        for c in (exported, name):
            if c:
                sh("podman", "rm", "-f", "-t", "5", c, check=False, timeout=120)
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp_path / "bus")
        shutil.rmtree(programs, ignore_errors=True)


def test_the_image_holds_what_the_daemonset_needs(image):
    """The entrypoint, the venv on PATH, the bus policy and the exporter's account, read from the built image."""
    config = json.loads(sh("podman", "image", "inspect", image).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["/usr/local/bin/gpukill-entrypoint"], config
    assert any(e.startswith("PATH=/opt/gpukill/bin:") for e in config["Env"]), config["Env"]
    r = sh(
        "podman",
        *RUNTIME,
        "run",
        *ULIMITS,
        "--rm",
        "--entrypoint",
        "sh",
        image,
        "-c",
        "getent passwd gpukill-exporter; test -r /usr/share/dbus-1/system.d/org.gpukill1.conf && echo policy; "
        "gpukillctl exporter --help >/dev/null && echo exporter",
    )
    assert "gpukill-exporter:x:9835:9835:" in r.stdout and "policy" in r.stdout and "exporter" in r.stdout, r.stdout
