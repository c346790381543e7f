"""What the tests share, imported as `helpers.X` (conftest.py puts tests/ on sys.path and keeps only fixtures
and hooks):

- testbed: a private system of real components (bus, polkitd, journald, gpukilld, users, victims)
- marks: `needs_root` and the reason real-component tests skip
- procs: real processes a test starts (`spawn`) and watches (`pid_alive`)
- waiting: `wait_until`, polling until something holds (returns it, or fails naming what did not happen)
- drm_fixtures: DRM hosts (/sys, /proc, debugfs, /dev/dri) in the kernel's formats
- nvml_host: a fake NVIDIA host (fake_nvml/: the C libnvidia-ml and nvidia-smi it builds and copies)
- sinks: loopback servers that guard notifications are sent to (SMTP, webhook, a relay that never answers)
- guard_inputs: the guard engine's inputs without a daemon (a settable clock, devices, processes, snapshots)

The programs that tests run as other users by path (tests/clients/) are not part of this package.
"""
