"""AMD, Intel and other DRM GPUs (amdgpu, i915, xe, msm, panfrost, panthor, v3d, asahi, ...) from what the
kernel exposes, without vendor tools: devices from sysfs, telemetry from sysfs and hwmon (pyrsmi first for
AMD where ROCm is installed), processes from DRM fdinfo and ROCm compute processes from KFD.

    backend     DrmBackend, the one name the rest of gpukilld uses
    discovery   which GPUs the host has (/sys/class/drm)
    scan        which processes hold DRM files (/proc), incrementally
    clients     which processes the kernel lists as DRM clients (debugfs dri/N/clients), so the scan can skip the rest
    fdinfo      what a DRM file's fdinfo says (drm-usage-stats keys)
    usage       fdinfo counters to per-client, per-process and per-device usage
    kfd         ROCm compute processes (/sys/class/kfd)
    telemetry   device telemetry from sysfs and hwmon; rsmi: the same through pyrsmi where ROCm is installed
    reset       how a GPU is reset and which others go with it
    sysfs       attribute readers: missing is None
"""

from .backend import DrmBackend

__all__ = ["DrmBackend"]
