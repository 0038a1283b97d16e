# The two set-up commands. Each creates .venv on first use and installs what it needs.
#   make run   - the whole pipeline on one machine, with a local directory as the bucket
#   make test  - the test suite (what CI runs)

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: run test clean browser rehearsal-tools rehearsal rehearsal-tpu mutants

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel

$(VENV)/.run-installed: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[extract,status]'
	touch $@

$(VENV)/.test-installed: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[extract,status,test]'
	touch $@

run: $(VENV)/.run-installed
	$(PY) tools/local_run.py

# The status page's browser test drives the distribution's Chromium (selenium never downloads one).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		echo "installing chromium and chromium-driver from the distribution's packages"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

# The boot rehearsal (tests/boot) builds a Debian root filesystem with mmdebstrap (cached under
# ~/.cache/gcs-spawner/rootfs, keyed on its recipe) and boots it in namespaces of its own (iproute2
# brings up its loopback). The Google Cloud CLI it runs is the machine's own. Where the tools cannot
# be installed (no root, no apt), the rehearsal skips and says why, except in CI (.ci/run).
rehearsal-tools:
	@if ! command -v mmdebstrap >/dev/null || ! command -v ip >/dev/null; then \
		echo "installing mmdebstrap and iproute2 from the distribution's packages"; \
		{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap iproute2 >/dev/null; } || \
		echo "could not install mmdebstrap and iproute2: the boot rehearsal (tests/boot) will skip"; \
	fi

# The whole fleet rehearsed (tests/boot/fleet.py), driven by `gcs-spawner` from a run file it writes
# (`up --yes`, the same `up` mid-run, `submit`, `down`, `merge`): a group of 3 working rehearsal machines and one
# refused the code (a failed boot) on the tiny model, a preemption, a late submit, every machine deleting itself,
# every boot's final record; its figures (per machine, per command and the wall time) are in docs/CLOUD.md. Needs
# root, as the boot rehearsal does. `make test` runs it at a smaller size (tests/boot/test_fleet.py).
rehearsal: $(VENV)/.test-installed rehearsal-tools
	$(PY) -m tests.boot.fleet

# The TPU fleet rehearsed (tests/boot/tpu_fleet.py), driven by `gcs-spawner` from a run file (`up` twice,
# `keep --once`, `status`, `down`, `merge`): a v5litepod-16 slice (4 hosts in namespaces of their own, on a network
# of their own, one jax.distributed program) and two v5litepod-8s made by hand on its queue, booted from the fake TPU
# API's queued resources; a follower killed mid-task, a preempted slice replaced, a preemption in the tail left
# alone, a host refused the code (a failed boot), every host's final record; its figures are in docs/CLOUD.md.
# Needs root. `make test` runs it at a smaller size (tests/boot/test_tpu_fleet.py: 4 tasks, not 6).
rehearsal-tpu: $(VENV)/.test-installed rehearsal-tools
	$(PY) -m tests.boot.tpu_fleet

test: $(VENV)/.test-installed browser rehearsal-tools
	$(PY) -m pytest -n 2

clean:
	rm -rf $(VENV) local-run

# Mutation testing of the queue core (mutmut; what it mutates and with which tests: [mutmut] in
# setup.cfg). Not part of `make test`: its cost and its last score are in docs/PROTOCOL-LOG.md.
mutants: $(VENV)/.test-installed
	$(PY) -m pip install --quiet -e '.[mutants]'
	rm -rf mutants
	$(PY) -m mutmut run --max-children 2
	$(PY) -m mutmut results
