"""Failures the core reports; the bus layer sends each as the D-Bus error named in `dbus_name`.

Kept free of D-Bus so backends and the kill path can raise them without knowing about the bus.
"""

from __future__ import annotations


class GpukillError(Exception):
    dbus_name = "org.gpukill1.Error.Failed"
    result = "failed"  # GPUKILL_RESULT in the audit trail


class NoSuchProcess(GpukillError):
    dbus_name = "org.gpukill1.Error.NoSuchProcess"
    result = "no-such-process"


class ProcessChanged(GpukillError):
    dbus_name = "org.gpukill1.Error.ProcessChanged"
    result = "process-changed"


class NotAGpuProcess(GpukillError):
    dbus_name = "org.gpukill1.Error.NotAGpuProcess"
    result = "not-a-gpu-process"


class Protected(GpukillError):
    dbus_name = "org.gpukill1.Error.Protected"
    result = "protected"


class NoSuchDevice(GpukillError):
    dbus_name = "org.gpukill1.Error.NoSuchDevice"
    result = "no-such-device"


class DeviceBusy(GpukillError):
    dbus_name = "org.gpukill1.Error.DeviceBusy"
    result = "device-busy"


class NotSupported(GpukillError):
    dbus_name = "org.gpukill1.Error.NotSupported"
    result = "not-supported"


class ResetFailed(GpukillError):
    dbus_name = "org.gpukill1.Error.ResetFailed"
    result = "reset-failed"


class InvalidPolicy(GpukillError):
    """A Guard policy that cannot be used; gpukill.policy.PolicyError carries each problem."""

    dbus_name = "org.gpukill1.Error.InvalidPolicy"
    result = "invalid-policy"


class InvalidArgs(GpukillError):
    dbus_name = "org.freedesktop.DBus.Error.InvalidArgs"
    result = "invalid-arguments"


class AccessDenied(GpukillError):
    dbus_name = "org.freedesktop.DBus.Error.AccessDenied"
    result = "denied"


class TooBusy(GpukillError):
    """A per-caller or global limit is reached (authorizations pending, policy tests running, replies queued):
    nothing was done; the same request later may succeed."""

    dbus_name = "org.gpukill1.Error.TooBusy"
    result = "busy"


class ReplyTooLarge(GpukillError):
    """The reply would not fit in one bus message: ask for pages (ListProcesses: filter keys limit, after)."""

    dbus_name = "org.gpukill1.Error.ReplyTooLarge"
    result = "too-large"


class ConfigError(Exception):
    """A configuration or device file is wrong; the message names FILE[:LINE] and what is wrong."""
