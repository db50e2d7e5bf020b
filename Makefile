# Two entry points, each working on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A second, small environment for the TEI clients that need huggingface_hub 1.x
# (langchain-huggingface pins it below 2); tests/integration/test_clients.py runs them in it.
HUB1_VENV ?= .venv-hub1
# torch is installed first and pinned, so that the rest of the install keeps it. On this
# project's machines pip finds the CPU build of 2.13.0 on local disk; elsewhere, a CPU-only
# box gets the CPU build with TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
export HF_HUB_OFFLINE ?= 1

.PHONY: setup tools serve test lint clean

setup: $(VENV)/.installed $(HUB1_VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

$(HUB1_VENV)/.installed: tests/clients/requirements-hub1.txt
	rm -rf $(HUB1_VENV)
	$(PYTHON) -m venv $(HUB1_VENV)
	$(HUB1_VENV)/bin/python -m pip install -q -r tests/clients/requirements-hub1.txt
	touch $@

serve: setup
	$(BIN)/embedsvc serve

# System tools the tests run for real, from Debian's packages: promtool (prometheus),
# nginx (the load balancer of the scale-out test) and kubectl (renders the kustomize base).
TOOLS := promtool:prometheus nginx:nginx kubectl:kubectl
tools:
	@missing=""; for t in $(TOOLS); do \
	  command -v $${t%%:*} >/dev/null || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

lint: setup
	$(BIN)/ruff check embedsvc tests bench deploy

test: lint tools $(HUB1_VENV)/.installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(HUB1_VENV) .pytest_cache
