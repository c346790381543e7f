"""deploy/kubernetes and deploy/container: the manifests validate against the Kubernetes API schemas, the
DaemonSet, the ConfigMap, the Containerfile and the entrypoint agree on paths, and the entrypoint runs the way
the DaemonSet runs it (the ConfigMap mounted at /etc/gpukill, an emptyDir at /run/dbus, the state hostPath,
the node's PID namespace) with gpukillctl reaching the daemon on the pod's bus and the ConfigMap's policy in force.
The image itself is built with buildah and run with podman in tests/package/test_image.py (`make
test-package`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers.marks import needs_root
from helpers.sinks import free_port
from helpers.testbed import PYTHON, REPO, Testbed, _kill_group
from helpers.waiting import wait_until

from gpukill.policy import load_directory

KUBE = REPO / "deploy" / "kubernetes"
CONTAINER = REPO / "deploy" / "container"
ENTRYPOINT = CONTAINER / "entrypoint.sh"


def _documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(KUBE.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _one(kind: str) -> dict:
    found = [doc for _, doc in _documents() if doc["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)} documents"
    return found[0]


def _entrypoint_setting(name: str) -> str:
    """A NAME=value line of the entrypoint, its $VARIABLES expanded from the lines above it."""
    values: dict[str, str] = {}
    for m in re.finditer(r"^([A-Z_]+)=(\S+)$", ENTRYPOINT.read_text(), re.M):
        values[m[1]] = re.sub(r"\$([A-Z_]+)", lambda v: values[v[1]], m[2])
    return values[name]


def _container(name: str = "gpukilld") -> dict:
    (container,) = [c for c in _one("DaemonSet")["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


def _mounts(container: str = "gpukilld") -> dict[str, dict]:
    """mountPath -> the volume behind it, for that container."""
    volumes = {v["name"]: v for v in _one("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in _container(container)["volumeMounts"]}


def _configmap_tree(dest: Path) -> None:
    """The files the kubelet makes of the ConfigMap volume mounted at /etc/gpukill (its items: key -> path)."""
    volume = _mounts()[str(Path(_entrypoint_setting("CONFIG")).parent)]
    data = _one("ConfigMap")["data"]
    assert volume["configMap"]["name"] == _one("ConfigMap")["metadata"]["name"]
    for item in volume["configMap"]["items"]:
        (dest / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (dest / item["path"]).write_text(data[item["key"]])


# -- the manifests --------------------------------------------------------------------------------------


def test_manifests_validate_against_the_kubernetes_api_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
    version = kv.utils.latest_version()
    kinds = []
    for path, doc in _documents():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD, not in the API schemas: test_service_monitor_selects_the_service
        try:
            kv.validate(doc, version, strict=True)  # strict: an unknown or misspelt field fails too
        except kv.ValidationError as e:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")
        kinds.append(doc["kind"])
    assert {"Namespace", "ConfigMap", "DaemonSet", "Service", "NetworkPolicy"} <= set(kinds)


def test_the_daemonset_runs_in_the_nodes_pid_namespace_with_the_mounts_of_each_backend():
    pod = _one("DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # /proc is the node's: its processes, their cgroups, pidfds to signal them
    mounts = _mounts()
    assert mounts["/dev"]["hostPath"]["path"] == "/dev"  # /dev/nvidia*, /dev/dri/*
    assert mounts["/sys"]["hostPath"]["path"] == "/sys"  # DRM: /sys/class/drm, hwmon
    nvml = [p for p in mounts if p.endswith("/libnvidia-ml.so.1")]
    assert len(nvml) == 1 and mounts[nvml[0]]["hostPath"]["path"].endswith("/libnvidia-ml.so.1")
    env = {e["name"]: e["value"] for e in _container()["env"]}
    assert str(Path(nvml[0]).parent) in env["LD_LIBRARY_PATH"].split(":")
    assert "emptyDir" in mounts[_entrypoint_setting("BUS_DIR")]  # the pod's own bus, no one else's
    assert mounts["/var/lib/gpukill"]["hostPath"]["path"] == "/var/lib/gpukill"
    for path, namespaces in (("metadata", _one("DaemonSet")), ("ConfigMap", _one("ConfigMap"))):
        assert namespaces["metadata"]["namespace"] == _one("Namespace")["metadata"]["name"], path


def test_the_configmaps_policy_is_valid_and_where_its_gpukilld_conf_says(tmp_path):
    _configmap_tree(tmp_path)
    conf = (tmp_path / "gpukilld.conf").read_text()
    policy_dir = re.search(r"^policy_dir\s*=\s*(\S+)", conf, re.M)[1]
    config_dir = Path(_entrypoint_setting("CONFIG")).parent
    in_pod = tmp_path / Path(policy_dir).relative_to(config_dir)
    assert list(in_pod.glob("*.yaml")), f"no policy where {policy_dir} is"
    assert load_directory(str(in_pod)).rules  # raises on an invalid policy, with FILE:LINE:COL


def test_service_monitor_selects_the_service():
    """ServiceMonitor is a CRD of the Prometheus operator, whose schema is not available offline: checked by
    structure (its selector matches the Service, its endpoint names a port the Service has)."""
    monitors = [doc for _, doc in _documents() if doc["kind"] == "ServiceMonitor"]
    if not monitors:
        pytest.skip("no exporter in the DaemonSet yet, so no Service or ServiceMonitor")
    (monitor,) = monitors
    service = _one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]


def _exporter_port() -> int:
    (port,) = _container("exporter")["ports"]
    assert port["protocol"] == "TCP"
    return port["containerPort"]


def test_only_the_scrapers_may_reach_the_exporter():
    """The exporter listens on 0.0.0.0 in the pod without authentication: a NetworkPolicy on the gpukilld pods
    admits, on the exporter's port alone, pods that are both in the monitoring namespace and Prometheus."""
    policy = _one("NetworkPolicy")
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == _one("Namespace")["metadata"]["name"]
    pod_labels = _one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    selector = spec["podSelector"]
    assert selector.get("matchLabels") and not selector.get("matchExpressions")
    assert all(pod_labels.get(k) == v for k, v in selector["matchLabels"].items()), "it must select the pods"
    assert "Ingress" in spec["policyTypes"]
    assert spec["ingress"], "no rule at all would admit no one, the exporter's scrapers included"
    for rule in spec["ingress"]:
        # no `from` (or an empty one) admits every source; an ipBlock admits whatever sits at those addresses
        assert rule.get("from"), rule
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector", "podSelector"}, ("both selectors in one peer", peer)
            for part in peer.values():
                assert part.get("matchLabels") and not part.get("matchExpressions"), peer
            assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
            assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
        assert rule.get("ports") == [{"protocol": "TCP", "port": _exporter_port()}], "the exporter's port only"
    (service_port,) = _one("Service")["spec"]["ports"]
    assert service_port["targetPort"] == _container("exporter")["ports"][0]["name"]


def test_the_exporter_runs_as_a_user_of_its_own():
    """Not root (the node's root, with hostPID), not nobody (65534: the node's, and many workloads' too, who
    could then signal or trace it): a uid and gid of its own, the one the image names, with nothing to gain."""
    context = _container("exporter")["securityContext"]
    uid, gid = context["runAsUser"], context["runAsGroup"]
    assert uid not in (0, 65534) and gid not in (0, 65534), context
    assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True and context["capabilities"] == {"drop": ["ALL"]}
    assert context.get("privileged") is not True and context["seccompProfile"] == {"type": "RuntimeDefault"}
    others = [c for c in _one("DaemonSet")["spec"]["template"]["spec"]["containers"] if c["name"] != "exporter"]
    assert all(c.get("securityContext", {}).get("runAsUser") != uid for c in others)
    assert _image_account() == (uid, gid), "the image has the exporter's account (dbus-daemon needs it)"


def _image_account() -> tuple[int, int]:
    """The uid and gid of the exporter's account, as the Containerfile's final stage makes it."""
    final = re.split(r"^FROM ", CONTAINER.joinpath("Containerfile").read_text(), flags=re.M)[-1]
    final = final.replace("\\\n", " ")
    group = re.search(r"groupadd --system --gid (\d+) gpukill-exporter", final)
    user = re.search(r"useradd --system --uid (\d+) --gid (\d+) .*?gpukill-exporter", final)
    assert group and user, "the image makes no gpukill-exporter account"
    assert user[2] == group[1]
    return int(user[1]), int(user[2])


# -- the image ------------------------------------------------------------------------------------------


def test_the_containerfile_installs_what_the_entrypoint_needs():
    text = CONTAINER.joinpath("Containerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    final = stages[-1]
    base = re.search(r"^ARG BASE=(\S+)$", text, re.M)[1]
    assert final.startswith("${BASE}") and base.startswith("docker.io/library/debian:bookworm")
    apt = re.search(r"apt-get install[^\n]*", final)[0]
    assert "dbus-daemon" in apt.split() and "python3" in apt.split()
    copies = dict(re.findall(r"^COPY (?:--from=\S+ )?(\S+) (\S+)$", final, re.M))
    assert copies["dbus/org.gpukill1.conf"] == _entrypoint_setting("GPUKILL_POLICY")
    assert (REPO / "dbus" / "org.gpukill1.conf").exists()
    installed = copies["deploy/container/entrypoint.sh"]
    assert re.search(rf'^ENTRYPOINT \["{re.escape(installed)}"\]', final, re.M)
    assert "pip install" in final and "/opt/gpukill/bin" in re.search(r"^ENV PATH=(\S+)", final, re.M)[1]
    assert not _container().get("command"), "the DaemonSet must not replace the image's entrypoint"


# -- the entrypoint, run as the DaemonSet runs it -------------------------------------------------------


def _in_session(sid: int) -> list[int]:
    """The processes of a session (the pod's: dbus-daemon and gpukilld were started in the entrypoint's)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == sid:
                    found.append(int(entry))
    return found


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


@contextlib.contextmanager
def _mount_point(path: str):
    """A directory to mount over in the pod's mount namespace; made (and removed after) if the host lacks it."""
    made = not os.path.isdir(path)
    if made:
        os.makedirs(path)
    try:
        yield path
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(path)


@needs_root
def test_entrypoint_runs_gpukilld_on_the_pods_bus_with_the_configmaps_policy(users, tmp_path):
    bed = Testbed()  # only for victims on simulated GPUs: no bus, no daemon of its own
    configmap, state = tmp_path / "configmap", tmp_path / "state"
    configmap.mkdir()
    state.mkdir()
    _configmap_tree(configmap)
    sim = yaml.safe_load((REPO / "examples" / "simulate.yaml").read_text())
    sim["scope"] = bed.scope
    (tmp_path / "simulate.yaml").write_text(yaml.safe_dump(sim))
    os.chmod(tmp_path, 0o755)
    config_dir = str(Path(_entrypoint_setting("CONFIG")).parent)
    policy = _entrypoint_setting("GPUKILL_POLICY")
    # The image's accounts: the host's, plus the exporter's as the Containerfile's useradd makes it (dbus-daemon
    # refuses a uid it cannot look up, so the image must have it).
    uid, gid = _image_account()
    (tmp_path / "passwd").write_text(
        Path("/etc/passwd").read_text() + f"gpukill-exporter:x:{uid}:{gid}::/nonexistent:/usr/sbin/nologin\n"
    )
    (tmp_path / "group").write_text(Path("/etc/group").read_text() + f"gpukill-exporter:x:{gid}:\n")
    # The image's files in a private mount namespace: the ConfigMap read-only at /etc/gpukill, an empty
    # /run/dbus, the state hostPath, and our bus policy alone where the Containerfile copies it. hostPID:
    # no PID namespace, so the daemon sees the victims as the pod sees the node's processes.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBUS_", "NOTIFY_SOCKET", "WATCHDOG"))}
    env["PATH"] = f"{Path(PYTHON).parent}:/usr/sbin:/usr/bin:/sbin:/bin"
    with _mount_point(config_dir), _mount_point("/var/lib/gpukill"):
        script = " && ".join(
            [
                f"mount --bind -o ro {configmap} {config_dir}",
                f"mount -t tmpfs tmpfs {_entrypoint_setting('BUS_DIR')}",
                f"mount --bind {state} /var/lib/gpukill",
                f"mount -t tmpfs tmpfs {Path(policy).parent}",
                f"cp {REPO / 'dbus' / 'org.gpukill1.conf'} {policy}",
                f"mount --bind {tmp_path / 'passwd'} /etc/passwd",
                f"mount --bind {tmp_path / 'group'} /etc/group",
                f'exec {ENTRYPOINT} "$@"',
            ]
        )
        log = tmp_path / "pod.log"
        with open(log, "wb") as out:
            pod = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "bash",
                    "-c",
                    script,
                    "bash",
                    *_container().get("args", []),
                    "--simulate",
                    str(tmp_path / "simulate.yaml"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

        def kubectl_exec(*args: str) -> subprocess.CompletedProcess:
            """`kubectl exec POD -- gpukillctl ARGS`: root in the pod's mount namespace, no bus address given."""
            return subprocess.run(
                ["nsenter", "-t", str(pod.pid), "-m", "--", "gpukillctl", *args],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
                cwd="/",
            )

        try:
            wait_until(
                lambda: kubectl_exec("status").returncode == 0 or pod.poll() is not None,
                30,
                lambda: log.read_text(errors="replace"),
            )
            assert pod.poll() is None, log.read_text(errors="replace")
            bus_config = _entrypoint_setting("BUS_CONFIG")  # the pod's bus is in the pod only
            assert os.path.exists(f"/proc/{pod.pid}/root{bus_config}") and not os.path.exists(bus_config)
            listing = json.loads(kubectl_exec("list", "--json").stdout)
            assert [(d["backend"], d["name"]) for d in listing["devices"]] == [
                ("simulated", d["name"]) for d in sim["devices"]
            ]

            # The ConfigMap's rule stops a miner in any pod; a process of the same user that is no miner stays.
            miner = bed.victim(users["owner"], gpu=0, comm="xmrig")
            trainer = bed.victim(users["owner"], gpu=0, comm="train")
            miner.wait(timeout=30)
            assert trainer.poll() is None
            status = json.loads(kubectl_exec("guard", "status", "--json").stdout)
            assert [r["name"] for r in status["rules"]] == ["block-crypto-miners"], status
            assert "block-crypto-miners" in log.read_text(errors="replace")  # the audit, in `kubectl logs`

            # The exporter container: its command, as its user, on the same emptyDir (a free port here).
            exporter = _container("exporter")
            assert _mounts("exporter")[_entrypoint_setting("BUS_DIR")] == _mounts()[_entrypoint_setting("BUS_DIR")]
            port = exporter["ports"][0]["containerPort"]
            command = [str(free_port()) if a == str(port) else a for a in exporter["command"]]
            uid = exporter["securityContext"]["runAsUser"]
            sidecar = subprocess.Popen(
                [
                    "nsenter",
                    "-t",
                    str(pod.pid),
                    "-m",
                    "--",
                    "setpriv",
                    f"--reuid={uid}",
                    f"--regid={exporter['securityContext']['runAsGroup']}",
                    "--clear-groups",
                    "--inh-caps=-all",
                    *command,
                ],
                env=env,
                cwd="/",
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            try:
                url = f"http://127.0.0.1:{command[command.index('--port') + 1]}/metrics"
                # a reading the daemon did not answer in time (a loaded machine) is served as gpukill_up 0: the
                # next scrape reads again
                metrics = wait_until(
                    lambda: (m := _scrape(url)) and "\ngpukill_up 1" in m and m,
                    60,
                    "the exporter never served /metrics with gpukilld up",
                )
            finally:
                _kill_group(sidecar)
            assert metrics.count("\ngpukill_device_up{") == len(sim["devices"])
            owner_memory = re.search(rf'^gpukill_user_gpu_memory_bytes{{user="{users["owner"].name}"}}', metrics, re.M)
            assert owner_memory, "the exporter as its own user does not see the owner's GPU process"

            # Deleting the pod: SIGTERM to the entrypoint stops gpukilld and the bus with it.
            os.kill(pod.pid, signal.SIGTERM)
            pod.wait(timeout=20)
            wait_until(lambda: not _in_session(pod.pid), 10, "the pod's processes outlived its entrypoint")
        finally:
            _kill_group(pod)
            bed.stop()
