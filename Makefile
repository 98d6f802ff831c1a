# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test serve bench clean

setup: $(STAMP)

# torch first, from the pinned CPU build, so nothing pulls a multi-GB CUDA build
# (nixl-cu13 depends on an unpinned torch: installed after it, it adds nothing CUDA).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

serve: setup
	$(VENV)/bin/pdserve generate --prompt "Explain context parallelism in one sentence." --max-new-tokens 32

bench: setup
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
