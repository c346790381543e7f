# gpukill developer entry points. `make test`, `make demo` and `make sandbox` work on a fresh Debian machine as root.
VENV ?= .venv
PY := $(VENV)/bin/python
# What the real-component tests and the demo run: the bus, polkitd, journald, unshare/nsenter/setpriv, gcc for
# the fake NVML library, gdb to freeze a daemon's main loop in the watchdog test, and groff-base (groff, tbl)
# to render the man pages in tests/test_manpages.py.
# python3-dbusmock: the notification server of tests/test_notify_agent.py, run with Debian's python3 (dbus-python
# does not build in the venv without libdbus and glib headers; Debian's brings python3-dbus and python3-gi).
# tmux: the real terminal that tests/test_top.py drives `gpukillctl top` in (send-keys, capture-pane).
# jq: docs/using.md's many-hosts example, run by tests/test_remote.py with hostile host names.
# uidmap: newuidmap/newgidmap, so that tests/test_people.py calls from a user namespace mapped to a user's
# subordinate uids (unshare --map-auto), as a user with an /etc/subuid range can.
# chromium, chromium-driver: the real browser the dashboard tests drive through Selenium (tests/helpers/browser.py)
APT_PACKAGES := dbus-daemon polkitd systemd util-linux gcc python3-venv gdb groff-base python3-dbusmock tmux prometheus openssh-server openssh-client jq uidmap chromium chromium-driver

.PHONY: all deps venv test test-gpu lint check demo sandbox bench clean deb rpm pkg-deps test-package

all: test

deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make: missing Debian packages:$$missing (run as root to install)"; exit 1; fi; \
	  echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# The venv is made from Debian's python3 so unprivileged test users can execute it (a pyenv under /root is 0700).
$(VENV)/.stamp: pyproject.toml
	/usr/bin/python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: deps $(VENV)/.stamp

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# The checks against a real NVIDIA driver, each skipped with the reason elsewhere: the backend compared with
# nvidia-smi (tests/gpu/test_real_nvidia.py), and suspend and resume through cuda-checkpoint, printing seconds per
# GiB (tests/gpu/test_suspend_real.py; GPUKILL_SUSPEND_GIB=N sets the memory held, 4 GiB by default).
test-gpu: venv
	$(PY) -m pytest -q -rs tests/gpu

# lint and check need the venv alone, not deps' Debian packages: they run as any user once the venv exists.
lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The fast loop, as any user, in about a minute on two idle cores: lint, formatting, types ([tool.mypy]),
# dead code ([tool.vulture]) and the tests that need no root (GPUKILL_PURE: tests/helpers/testbed.py skips
# the others).
check: $(VENV)/.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/vulture
	GPUKILL_PURE=1 $(PY) -m pytest -q -n 4 -p no:cacheprovider -rfE

demo: venv
	$(PY) examples/demo.py

# The demo's private machine kept running: it prints the lines to paste into another shell; Ctrl-C ends it.
sandbox: venv
	$(PY) examples/sandbox.py

bench: venv
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) bench/cost
	$(PY) bench/guard_cycle

# --- packages --------------------------------------------------------------------------------------------
# buildah, podman, runc: tests/package/test_image.py builds the Kubernetes image and runs it (runc: crun, podman's
# default, refuses the hybrid cgroup mounts of these machines)
PKG_APT_PACKAGES := debhelper dh-python dpkg-dev fakeroot lintian rpm python3-pip debootstrap systemd-container \
  buildah podman runc
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BUILD := build

pkg-deps:
	@missing=""; for p in $(PKG_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi

# The source as it is in the working tree (tracked and untracked-not-ignored files), plus the wheels that
# the packages bundle (packaging/vendor-requirements.txt), for CPython 3.11 on x86-64 as bookworm has.
$(BUILD)/src: pkg-deps venv
	rm -rf $(BUILD)/src && mkdir -p $(BUILD)/src/generated/completions
	git ls-files -co --exclude-standard -z | xargs -0 tar -cf - | tar -xf - -C $(BUILD)/src
	$(PY) packaging/completions.py $(BUILD)/src/generated/completions
	/usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(BUILD)/src/wheels -r packaging/vendor-requirements.txt
	/usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(BUILD)/src/wheels-serve -r packaging/vendor-serve-requirements.txt

deb: $(BUILD)/src
	rm -rf $(BUILD)/src/debian && cp -r packaging/debian $(BUILD)/src/debian
	cd $(BUILD)/src && dpkg-buildpackage -us -uc -b
	mkdir -p dist && rm -f dist/gpukill*_$(VERSION)_*.deb && mv $(BUILD)/gpukill*_$(VERSION)_*.deb dist/
	rm -f $(BUILD)/gpukill_$(VERSION)_*
	lintian --fail-on error,warning dist/gpukill_$(VERSION)_amd64.deb dist/gpukill-serve_$(VERSION)_amd64.deb \
	  dist/gpukill-exporter_$(VERSION)_all.deb

rpm: $(BUILD)/src
	mkdir -p $(BUILD)/rpm/SOURCES dist
	cp systemd/gpukill.sysusers systemd/gpukill-exporter.sysusers $(BUILD)/rpm/SOURCES/
	tar -czf $(BUILD)/rpm/SOURCES/gpukill-$(VERSION).tar.gz -C $(BUILD) --transform 's,^src,gpukill-$(VERSION),' src
	rpmbuild -bb --nodeps --define "_topdir $(CURDIR)/$(BUILD)/rpm" --define "version $(VERSION)" packaging/rpm/gpukill.spec
	cp $(BUILD)/rpm/RPMS/x86_64/gpukill-*$(VERSION)-*.rpm $(BUILD)/rpm/RPMS/noarch/gpukill-*$(VERSION)-*.rpm dist/
	rpm -qlp dist/gpukill-$(VERSION)-*.rpm dist/gpukill-serve-$(VERSION)-*.rpm dist/gpukill-exporter-$(VERSION)-*.rpm

# Install the .debs into a debootstrapped bookworm booted under systemd-nspawn and check them there; the .rpms
# hold the same files, split the same way; the Kubernetes image built with buildah and run with podman.
test-package: venv deb rpm
	$(PY) -m pytest -q -rs -s tests/package

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache $(BUILD) dist
