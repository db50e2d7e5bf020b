#!/usr/bin/env bash
# The same benchmark on a CUDA machine, in under five minutes once installed:
#   bash bench/gpu.sh            # appends its figures to bench/RESULTS.md
# Installs the CUDA build of torch (the default PyPI wheel on Linux), wrk if missing, then
# runs embedsvc, the naive app and the simulated device for 10 s per scenario. Infinity is
# left out here to keep to five minutes; add it with ONLY=embedsvc,naive,infinity,sim.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
make setup TORCH_PIP_ARGS=""
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export HF_HUB_OFFLINE=1
timeout 290 .venv/bin/python bench/run.py --device cuda --duration 10 \
  --only "${ONLY:-embedsvc,naive,sim}" --record
