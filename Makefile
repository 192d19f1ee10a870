# pdserve: `make run` brings up the cluster on the embedded tiny model; `make test` runs the tests
# (`make test-fast`: those that do not start Ray).
# Both create .venv and install everything on first use. On a CPU machine torch is pinned to the
# CPU wheel first, so pip never pulls a CUDA build; GPU users: `make run TORCH_SPEC=torch`.

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup run test test-fast lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/pdserve serve --demo

test: setup
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# Everything that does not start Ray: a few minutes at most.
test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
