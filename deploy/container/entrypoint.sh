#!/bin/bash
# The gpukill pod's entrypoint: a system bus of the pod's own with gpukill's bus policy, then gpukilld on it.
# Arguments are gpukilld's (e.g. --log-level debug). Both run as children of this script, which exits when
# either does (the kubelet then restarts the container: a daemon without its bus is no use) and passes
# SIGTERM on to both. The bus is private to the pod: its socket is in /run/dbus, an emptyDir that only this
# pod's containers mount; `kubectl exec ... gpukillctl` reaches it there, as root in the container.
set -euo pipefail

BUS_DIR=/run/dbus
BUS_SOCKET=$BUS_DIR/system_bus_socket
BUS_CONFIG=$BUS_DIR/pod-bus.conf
# Where the image installs our bus policy, as the .deb and the rpm do (dbus/org.gpukill1.conf).
GPUKILL_POLICY=/usr/share/dbus-1/system.d/org.gpukill1.conf
# The ConfigMap is mounted at /etc/gpukill: gpukilld.conf and guard.d/*.yaml.
CONFIG=/etc/gpukill/gpukilld.conf

fail() { echo "gpukill-entrypoint: $*" >&2; exit 1; }
for tool in dbus-daemon gpukilld; do
    command -v "$tool" >/dev/null || fail "$tool is not installed in this image"
done
[ -r "$GPUKILL_POLICY" ] || fail "no bus policy at $GPUKILL_POLICY"
[ -r "$CONFIG" ] || fail "no $CONFIG: mount the gpukill-config ConfigMap at /etc/gpukill"

mkdir -p "$BUS_DIR"
rm -f "$BUS_SOCKET"
# The default-deny policy of Debian's /usr/share/dbus-1/system.conf, then ours: only root owns org.gpukill1,
# anyone may call it. No <user>: dbus-daemon stays root, as the container has no messagebus account to drop to.
cat > "$BUS_CONFIG" <<CONF
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path=$BUS_SOCKET</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"
          send_member="UpdateActivationEnvironment"/>
  </policy>
  <include>$GPUKILL_POLICY</include>
</busconfig>
CONF

dbus-daemon --config-file="$BUS_CONFIG" --nofork --nopidfile &
bus=$!
for _ in $(seq 100); do
    [ -S "$BUS_SOCKET" ] && break
    kill -0 "$bus" 2>/dev/null || fail "dbus-daemon exited before creating $BUS_SOCKET"
    sleep 0.1
done
[ -S "$BUS_SOCKET" ] || fail "dbus-daemon did not create $BUS_SOCKET within 10 s"

export DBUS_SYSTEM_BUS_ADDRESS=unix:path=$BUS_SOCKET
gpukilld --config "$CONFIG" "$@" &
daemon=$!

stop() { kill -TERM "$daemon" "$bus" 2>/dev/null || true; }
trap stop TERM INT
status=0
wait -n "$bus" "$daemon" || status=$?
stop
wait "$daemon" 2>/dev/null || true
wait "$bus" 2>/dev/null || true
echo "gpukill-entrypoint: stopped (exit status $status)" >&2
exit "$status"
