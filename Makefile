# Two entry points for a newcomer: `make demo` and `make test`. Both install what is missing first.
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
DEMO  ?= .prx/demo

DEMO_ENV = DAGSTER_HOME=$(CURDIR)/.prx/dagster PRX_ROOT=$(CURDIR)/$(DEMO)/corpus PRX_SOURCES=$(CURDIR)/$(DEMO)/sources/sources.yaml

.PHONY: setup demo ui browse test doctor clean lock

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/prx-corpus demo-sources $(DEMO)/sources
	$(BIN)/prx-corpus doctor --root $(DEMO)/corpus --no-ray
	$(DEMO_ENV) $(BIN)/prx-corpus build --sources $(DEMO)/sources/sources.yaml --root $(DEMO)/corpus
	@echo; echo "Open the Dagster UI on this corpus (runs, checks, metadata): make ui  (then http://127.0.0.1:3000)"
	@echo "Browse the corpus itself (search, neighbours, duplicates, plots): make browse  (then http://127.0.0.1:8080)"

ui: setup
	$(DEMO_ENV) $(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

browse: setup
	$(BIN)/prx-corpus browse --root $(DEMO)/corpus

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

doctor: setup
	$(BIN)/prx-corpus doctor --root $(DEMO)/corpus

clean:
	rm -rf .prx .pytest_cache test-artifacts

# Re-resolve the locks after changing dependencies in pyproject.toml: requirements.lock (with the
# test extra: what make test installs) and requirements-runtime.lock, the same versions without the
# test tools (what make demo and the images install). img2dataset (a test tool) still names the
# Python 3.6 backport `dataclasses`, which no Python 3.11 installs: it is left out, and setup.sh
# installs the lock with --no-deps (the lock is complete).
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --python-version 3.11 --python-platform x86_64-unknown-linux-gnu \
	--no-header --annotation-style line --no-emit-package dataclasses
lock:
	$(BIN)/pip install -q uv && $(UV_COMPILE) --extra test -o requirements.lock
	$(UV_COMPILE) -c requirements.lock -o requirements-runtime.lock
