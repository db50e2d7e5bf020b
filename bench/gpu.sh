#!/usr/bin/env bash
# The same benchmarks on a CUDA machine, in one command once installed (about 15 minutes):
#   bash bench/gpu.sh            # appends its figures to bench/RESULTS.md
#   bash bench/gpu.sh --cpu      # the same steps on the CPU, short, nothing recorded: a check
#                                # of this script on a machine without a GPU
# Installs the CUDA build of torch (the default PyPI wheel on Linux) and wrk if missing, then:
# 1. bench/run.py: embedsvc, the naive app and the simulated device, 10 s per scenario
#    (Infinity is left out; add it with ONLY=embedsvc,naive,infinity,sim);
# 2. bench/workers.py model: embedsvc serve --workers 2 against one process on the device,
#    32 x 1 and 4 x 32, rounds alternating;
# 3. bench/workers.py sim: the same over the simulated zero-cost device, with the bare app
#    under waitress and under gunicorn -w 2, and the engine process's CPU per request;
# 4. bench/workers.py memory: embedsvc serve --workers 4 and gunicorn -w 4 (with and without
#    --preload) against EMBEDSVC_ENGINE=inline (each worker its own model): the processes
#    that map libcuda (hold a CUDA context; exactly one, the engine, is the goal), their RSS
#    and PSS, and each one's device memory from nvidia-smi.
# Each step runs under its own timeout; a step that fails stops the script (set -e). On a
# machine shared with other benchmarks, run it under their lock:
#   flock /tmp/embedsvc-bench.lock bash bench/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda seconds=10 rounds=2 maps=libcuda record=(--record)
if [[ "${1:-}" == "--cpu" ]]; then
  device=cpu seconds=3 rounds=1 maps=onnxruntime record=()
elif [[ $# -gt 0 ]]; then
  echo "usage: bash bench/gpu.sh [--cpu]" >&2
  exit 2
fi
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
if [[ $device == cuda ]]; then
  make setup TORCH_PIP_ARGS=""
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
else
  make setup
fi
export HF_HUB_OFFLINE=1
py=.venv/bin/python
timeout 290 $py bench/run.py --device "$device" --duration "$seconds" \
  --only "${ONLY:-embedsvc,naive,sim}" "${record[@]}"
timeout 400 $py bench/workers.py model --device "$device" --duration "$seconds" \
  --rounds "$rounds" "${record[@]}"
timeout 300 $py bench/workers.py sim --duration "$seconds" --rounds "$rounds" "${record[@]}"
timeout 400 $py bench/workers.py memory --device "$device" --maps "$maps" "${record[@]}"
