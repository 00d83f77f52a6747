# rtfleet — the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rtfleet-installed
export PATH := $(CURDIR)/$(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# Lab hosts for the demo: NAME=TOPOLOGY (see lab/topologies/).
DEMO_HOSTS ?= server1=server-nps2 vmware1=vmware-like

.PHONY: help setup deps demo demo-down test test-vm lint sanity collection unit molecule molecule-all drills bench soak clean

help:
	@echo "make demo   - bring up the QEMU lab and run site.yml against it"
	@echo "make test   - lint, unit tests and the Molecule scenarios (boot and reboot lab VMs)"
	@echo "make setup  - create .venv with rtfleet and the pinned tool chain"
	@echo "make drills - fault drills (power cuts, a killed controller...) on a lab VM"
	@echo "make bench  - topology + plan timing on a 2-socket 256-CPU tree"
	@echo "make soak   - shminfer: 8 honest clients and one attacking peer for 10 minutes"

$(STAMP): pyproject.toml shminfer/pyproject.toml shminfer/setup.py shminfer/src/shminfer/_fast.c requirements/dev.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "rtfleet needs Python >= 3.11 (ansible-core 2.19)")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements/dev.txt
	@# rtfleet first: a venv from before 0.2 has an rtfleet whose uninstall takes shminfer's script.
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip install --quiet --no-deps -e shminfer/
	@# This checkout is the rtfleet.fleet collection for the venv's Ansible and for the tests
	@# (Ansible scans sys.path for ansible_collections/, as for the ansible package's own).
	site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  mkdir -p $$site/ansible_collections/rtfleet && ln -sfn $(CURDIR) $$site/ansible_collections/rtfleet/fleet
	touch $@

setup: $(STAMP)

# Debian packages for the lab (QEMU, image builder); installs only what is missing.
deps:
	lab/install-deps.sh

demo: setup deps
	$(BIN)/rtfleet lab image
	$(BIN)/rtfleet lab up $(DEMO_HOSTS)
	$(BIN)/ansible-playbook site.yml
	@echo "Report: $(CURDIR)/reports/report.html (also report.md, fleet.json, plots/; per-host results in reports/results/)"
	@echo "Lab hosts stay up for exploring: '$(BIN)/rtfleet lab status', '$(BIN)/rtfleet lab ssh HOST'; 'make demo-down' removes them."

demo-down: setup
	$(BIN)/rtfleet lab down --all

lint: setup
	$(BIN)/yamllint --strict .
	$(BIN)/ansible-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/antsibull-changelog lint
	tests/sanity/run.sh

# ansible-test sanity for the collection's modules, plugins and metadata (also part of lint).
sanity: setup
	tests/sanity/run.sh

# The collection as users get it: installed from the built tarball into an empty directory,
# listed by ansible-doc, and rtfleet.fleet.assess run there against a lab host.
collection: setup deps
	$(BIN)/rtfleet lab image
	tests/collection/run.sh

# One pytest worker per CPU, a test file per worker (module fixtures are built once).
# shminfer runs its C hot path (shminfer._fast) where `make setup` built it; its tests run
# a second time on the pure-Python fallback (SHMINFER_PURE=1), so CI covers both paths.
SHMINFER_TESTS := $(wildcard tests/unit/test_shminfer*.py) tests/unit/test_sdnotify.py
# In CI (CI=true) a missing C path is an error, not a silent second pure run.
unit: setup deps
	@$(BIN)/python -c 'import os, sys, shminfer._sys as s; print("shminfer path under test:", s.IMPLEMENTATION); sys.exit(os.environ.get("CI") == "true" and s.IMPLEMENTATION != "c" and "shminfer._fast was not built: install a C compiler and the Python headers (gcc, python3-dev), then make clean setup")'
	$(BIN)/pytest -m "not vm" -n auto --dist loadfile
	SHMINFER_PURE=1 $(BIN)/pytest -m "not vm" -n auto --dist loadfile $(SHMINFER_TESTS)

# Scenarios that boot lab VMs; `make molecule MOLECULE_SCENARIOS=kubelet` runs another set.
# CI runs `site`: the whole flow (site.yml) on the server-shaped 48-vCPU host and a
# VMware-like one, the trial boot into the RT kernel included. lab-smoke, host (idempotence,
# check mode, a bad trial boot), kubelet and site-epyc (the flow on the 8-vCPU EPYC-like
# host, with the runtime step's idempotence and check-mode runs) take 10-60 min each on 2
# cores under TCG: `make molecule-all`.
MOLECULE_SCENARIOS ?= site
# Each scenario's log is kept in $(LOGDIR); on a failure, what failed is printed last.
LOGDIR ?= .logs
molecule: setup deps
	mkdir -p $(LOGDIR)
	set -eo pipefail; for s in $(MOLECULE_SCENARIOS); do \
	  $(BIN)/molecule test -s $$s 2>&1 | tee $(LOGDIR)/molecule-$$s.log \
	    || { .ci/excerpt $(LOGDIR)/molecule-$$s.log; exit 1; }; done

molecule-all:
	$(MAKE) molecule MOLECULE_SCENARIOS="lab-smoke host kubelet site site-epyc"

test: lint unit collection molecule

# Fault drills on one 8-vCPU lab host (tests/drills, docs/drills.md): each injects its fault
# for real (SIGKILL to ansible-playbook, a power cut of the guest, ...) and checks the host
# converges after it; its own lab state, and no QEMU left running afterwards.
# DRILLS=expr runs some of them (pytest -k).
DRILLS ?=
drills: setup deps
	$(BIN)/rtfleet lab image
	$(BIN)/pytest tests/drills -v -p no:cacheprovider --durations=0 $(if $(DRILLS),-k "$(DRILLS)")

# The pytest tests that boot lab VMs themselves (the Molecule scenario covers CI).
test-vm: setup deps
	$(BIN)/pytest -m vm

bench: setup
	$(BIN)/python benchmarks/bench_plan.py

# shminfer under one hostile peer (issue 27): 8 honest clients and every attack, 10 minutes.
SOAK_MINUTES ?= 10
soak: setup
	$(BIN)/python benchmarks/soak_shminfer.py --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) build dist src/*.egg-info shminfer/build shminfer/src/*.egg-info shminfer/src/shminfer/*.so .pytest_cache .ruff_cache .hypothesis
