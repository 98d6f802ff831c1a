# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-system lint serve bench clean scan-tools

setup: $(STAMP)

# torch first, from the pinned CPU build, so nothing pulls a multi-GB CUDA build
# (nixl-cu13 depends on an unpinned torch: installed after it, it adds nothing CUDA).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

# checkov (tests/deploy/test_deploy_scan.py) in a venv of its own: its pins would downgrade packaging
# and networkx in the project venv
CHECKOV_VERSION := 3.3.30
SCAN_VENV ?= $(HOME)/.cache/pdserve/checkov-$(CHECKOV_VERSION)

scan-tools: $(SCAN_VENV)/bin/checkov

$(SCAN_VENV)/bin/checkov:
	$(PYTHON) -m venv $(SCAN_VENV)
	$(SCAN_VENV)/bin/pip install -q checkov==$(CHECKOV_VERSION)

# the formatter's check and the lint set of pyproject.toml ([tool.ruff]); `ruff format .` fixes layout
lint: setup
	$(VENV)/bin/ruff format --check pdserve tests bench docs
	$(VENV)/bin/ruff check pdserve tests bench docs

test: setup scan-tools lint
	PDSERVE_CHECKOV=$(SCAN_VENV)/bin/checkov $(PY) -m pytest -q -n 2 --dist worksteal --durations=25 tests

# root only (CI runs it after `make test`): prefill and decode hosts in network namespaces, the image
# built offline, the compose stack up and down, with a dockerd of its own (.ci/system); under plain
# `make test` these tests skip
test-system: setup
	PY=$(PY) .ci/system

# the whole stack on the built-in small model: router, a prefill instance (C_p = 2), a decode
# instance (W = C_d = 2); it prints the URL and an example request; Ctrl-C stops everything
serve: setup
	$(VENV)/bin/pdserve up --prefill-cp 2 --decode-tp 2 --decode-dcp 2

# every bench in sequence, then the README's table from bench/results (QUICK=1: a smoke run of each
# in under 15 minutes, its results in a temporary folder)
bench: setup
	$(PY) bench/run_all.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) build *.egg-info
