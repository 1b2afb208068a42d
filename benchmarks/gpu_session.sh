#!/usr/bin/env bash
# The GPU measurements the benchmark tables still lack, as one call of a lent GPU machine (about 9 minutes on an
# H200 with a warm start; each part has its own time limit, so a slow part costs its limit, not the rest):
#   1. the padding table (`gpu_suite.py --lanes`): one vmap over the cohort against the lane plan, the ragged
#      and streamed engines, the vectorized torch baseline and the torch loop, on log-normal clients, each row
#      with its roofline fractions (the device's measured matmul peak and copy bandwidth);
#   2. compiling in a 100-round FedTP run with `vit_small` at its paper's per-client size, under the automatic
#      backend choice (`compile_count.py --setting fedtp_cifar10 --backends auto`): programs, seconds, share.
# Needs jax with CUDA (torch with CUDA for the torch rows) and CIFAR-10 where JAXFL_DATA_DIR points (part 2).
#
#   mkdir -p runs/device_data/cifar10 && cp ../shared/data/cifar10/*.npz runs/device_data/cifar10/
#   # device tool: carry ["runs/device_data"], timeout_s 600, command (the copy there has no .git: name the
#   # commit, `git rev-parse --short HEAD` here, with a clean working tree):
#   COMMIT=<commit> JAXFL_DATA_DIR=$PWD/runs/device_data bash benchmarks/gpu_session.sh "$OUT"
#   SMOKE=1 JAXFL_DATA_DIR=../shared/data bash benchmarks/gpu_session.sh /tmp/gpu_smoke   # the plumbing, any CPU
#
# Results: OUT/env.txt (device, versions, commit), OUT/lanes/ (results.json, results.md), OUT/fedtp_compile.json,
# OUT/log.txt (everything printed).
set -u
OUT=${1:?usage: gpu_session.sh OUT}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python}
exec > >(tee -a "$OUT/log.txt") 2>&1

{
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>/dev/null \
    || echo "no torch"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ -n "${SMOKE:-}" ]; then
  # tiny versions of both parts: checks the commands and their outputs, not the device
  timeout 900 $PY benchmarks/gpu_suite.py --out "$OUT/lanes" --smoke
  timeout 900 $PY benchmarks/compile_count.py --setting fedtp_cifar10 --backends auto --rounds 2 \
    --out "$OUT/fedtp_compile.json" --model vit_tiny --local-epochs 1
else
  timeout 300 $PY benchmarks/gpu_suite.py --out "$OUT/lanes" --lanes --budget-s 270
  echo "lanes: rc $?"
  timeout 250 $PY benchmarks/compile_count.py --setting fedtp_cifar10 --backends auto --rounds 100 \
    --out "$OUT/fedtp_compile.json"
  echo "fedtp compile: rc $?"
fi
