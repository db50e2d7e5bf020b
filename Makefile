# Two entry points, each working on a fresh machine: `make serve` and `make test`.
# Two installs into $(VENV): `make setup-serve` (the package with its `torch` extra, which
# exports the bundled model's record on the first start and serves it without PyTorch from
# then on: what `make serve` needs) and `make setup` (that plus the `test` extra and
# $(HUB1_VENV), what `make test` needs). Every target installs first when needed. A
# deployment installs the package alone, without PyTorch (docs/deployment.md).
VENV ?= .venv
BIN := $(VENV)/bin
# What the install in $(VENV) was made with (INSTALLED_PYTHON, INSTALLED_TORCH_PIP_ARGS,
# INSTALLED_KEY), written after a successful install; absent before the first one.
INSTALLED := $(VENV)/install.mk
-include $(INSTALLED)
# A value given once (command line or environment) is remembered by the install, so that a
# later plain `make test` keeps the torch build chosen by `make setup TORCH_PIP_ARGS=...`.
PYTHON ?= $(or $(INSTALLED_PYTHON),python3)
# torch is installed first and pinned, so that the rest of the install keeps it. Where pip
# finds no local CPU build, plain PyPI gives Linux the multi-GB CUDA build; a CPU-only box
# asks for the CPU build with TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
# A second, small environment for the TEI clients that need huggingface_hub 1.x
# (langchain-huggingface pins it below 2); tests/integration/test_clients.py runs them in it.
HUB1_VENV ?= .venv-hub1
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?= $(INSTALLED_TORCH_PIP_ARGS)
export HF_HUB_OFFLINE ?= 1

# A different interpreter or torch source than the install's rebuilds $(VENV) from scratch:
# pip would otherwise keep the torch build already there, which satisfies the same pin.
INSTALL_KEY := $(strip $(PYTHON) | $(TORCH_SPEC) | $(TORCH_PIP_ARGS))
ifneq ($(INSTALL_KEY),$(strip $(INSTALLED_KEY)))
REINSTALL := FORCE
endif
quote = '$(subst ','\'',$(1))'

# The install stamps: serving only, or serving and testing.
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed
# A venv that holds the test install serves as it is: `make serve` after `make test` installs
# nothing more, and a rebuild (changed pyproject.toml or torch source) keeps the test extra.
SERVE_INSTALL := $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(SERVE_STAMP))

.PHONY: setup setup-serve tools serve test coverage lint clean FORCE

setup-serve: $(SERVE_INSTALL)

setup: $(TEST_STAMP) $(HUB1_VENV)/.installed

# $(call install,PIP_TARGET): torch first, pinned, then the package; remember the inputs.
define install
	$(PYTHON) -m venv $(if $(REINSTALL),--clear) $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -q -e "$(1)"
	printf '%s\n' $(call quote,INSTALLED_PYTHON := $(PYTHON)) \
	  $(call quote,INSTALLED_TORCH_PIP_ARGS := $(TORCH_PIP_ARGS)) \
	  $(call quote,INSTALLED_KEY := $(INSTALL_KEY)) > $(INSTALLED)
	touch $@
endef

$(SERVE_STAMP): pyproject.toml $(REINSTALL)
	$(call install,.[torch])

$(TEST_STAMP): pyproject.toml $(REINSTALL)
	$(call install,.[test])

$(HUB1_VENV)/.installed: tests/clients/requirements-hub1.txt
	rm -rf $(HUB1_VENV)
	$(PYTHON) -m venv $(HUB1_VENV)
	$(HUB1_VENV)/bin/python -m pip install -q -r tests/clients/requirements-hub1.txt
	touch $@

serve: $(SERVE_INSTALL)
	$(BIN)/embedsvc serve

# System tools the tests run for real, as apt packages: promtool (Debian's prometheus), nginx
# (the load balancer of the scale-out test), kubectl (renders the kustomize base; from
# Kubernetes' apt repository, which must be configured for apt-get to find it) and chromium
# (the /docs page in a real browser).
# Missing ones are installed with apt-get, which needs root; the README says so.
TOOLS := promtool:prometheus nginx:nginx kubectl:kubectl chromium:chromium
tools:
	@missing=""; for t in $(TOOLS); do \
	  command -v $${t%%:*} >/dev/null || missing="$$missing $${t#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make test needs the packages$$missing (promtool, nginx, kubectl, chromium):" \
	    "run it as root on Debian or Ubuntu to install them with apt-get, or install them" \
	    "yourself (sudo apt-get install$$missing)" >&2; \
	  exit 1; \
	fi; \
	echo "installing$$missing with apt-get"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing \
	  >/dev/null || { echo "apt-get could not install$$missing (kubectl is not in Debian's" \
	    "archive: it comes from Kubernetes' apt repository, https://pkgs.k8s.io)" >&2; exit 1; }

lint: setup
	$(BIN)/ruff check embedsvc tests bench deploy
	$(BIN)/mypy

# Test files run in one process more than the machine has cores (most of their time is
# spent waiting on the servers they start), at most 8. On 2 cores in the working tree, 3
# processes ran the suite in 270-274 s and 497-510 CPU-s, 4 in 295-326 s and 547-591 CPU-s;
# on a fresh clone the two did not differ measurably (bench/RESULTS.md).
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 8 ? n + 1 : 8 )))
# Tests marked `alone` assert a latency or a rate claimed for cores otherwise idle; beside
# two other test files on 2 cores they failed about one run in three (an engine's restart or
# a burst's deadline sharing the cores), so they run after the rest, one at a time.
test: lint tools $(HUB1_VENV)/.installed
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile -m "not alone"
	$(BIN)/python -m pytest -m alone

# The same run, measuring line coverage of embedsvc/ in the test processes and every Python
# process they start (pyproject.toml's [tool.coverage.run]); slower, so not part of `test`.
coverage: lint tools $(HUB1_VENV)/.installed
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile -m "not alone" --cov
	$(BIN)/python -m pytest -m alone --cov --cov-append --cov-report=term:skip-covered

clean:
	rm -rf $(VENV) $(HUB1_VENV) .pytest_cache .coverage .coverage.*
