# Two entry points, each doing all of its own set-up on a fresh Debian bookworm machine (as root):
#   make demo   installs what is missing and runs the main job on the embedded stack
#   make test   installs what is missing and runs the test suite
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# test files run whole and in order on each worker; every stack has its own data dir, ports and
# cgroup parent, so two files' stacks share the machine as two users' stacks would
PYTEST_WORKERS ?= 2

.PHONY: compose-check demo test setup system venv sdists bench clean

setup: system venv sdists

system:
	@bash scripts/setup-system.sh

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# the pinned sdists of the real-package environments and the AsyncAPI schema the contract test
# validates against, fetched once so tests run offline
sdists: venv
	@$(PY) scripts/fetch-sdists.py >/dev/null
	@$(PY) scripts/fetch-specs.py >/dev/null

demo: setup
	$(VENV)/bin/corral demo

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.run_all

compose-check: setup
	$(PY) deploy/compose_check.py

clean:
	rm -rf $(VENV) .pytest_cache
