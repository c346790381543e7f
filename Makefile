# gpukill developer entry points. `make test` and `make demo` work on a fresh Debian machine as root.
VENV ?= .venv
PY := $(VENV)/bin/python
# What the real-component tests and the demo run: the bus, polkitd, journald, unshare/nsenter, and what
# building systemd-python needs.
APT_PACKAGES := dbus-daemon polkitd systemd util-linux libsystemd-dev pkg-config gcc python3-dev python3-venv

.PHONY: all deps venv test test-gpu lint demo bench clean

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

# The NVIDIA checks against a real driver, compared with nvidia-smi; skipped with the reason elsewhere.
test-gpu: venv
	$(PY) -m pytest -q -rs tests/gpu

lint: venv
	$(VENV)/bin/ruff check .

demo: venv
	$(PY) examples/demo.py

bench: venv
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) bench/list_latency
	$(PY) bench/nvml_peers

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
