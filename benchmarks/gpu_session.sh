#!/usr/bin/env bash
# The GPU measurements the benchmark tables still lack, as one call of a lent GPU machine (about 9.5 minutes on an
# H200 with a warm start; each part has its own time limit, so a slow part costs its limit, not the rest):
#   1. the padding table (`gpu_suite.py --lanes`): one vmap over the cohort against the lane plan (with the step
#      overhead `jaxfl run` uses) and the vectorized torch baseline, on log-normal clients (and the label-skewed
#      FedAvg CNN), each row with its roofline fractions (the device's measured matmul peak and copy bandwidth);
#      the rows the table at b65f0a4 lacks first;
#   2. the small models' lane plans at cohort 1,000 (2NN, logreg; one and 10 rounds per call) with XLA's
#      command buffers (CUDA graphs) at their default and with while loops and conditionals added
#      (`--xla_gpu_enable_command_buffer=...,CONDITIONAL,WHILE`): a plan's round is ~70 sequential steps whose
#      cost is mostly per-step launches and the loop predicate's read back to the host, which a while loop
#      inside a CUDA graph does not pay;
#   3. compiling a FedTP cohort's local training with `vit_small`'s 8 blocks unrolled (the library) and as one
#      scan (`vit_compile.py`: does one block body instead of 8 copies shorten a GPU compile?);
#   4. compiling in a FedTP run with `vit_small` at its paper's per-client size, under the automatic backend
#      choice (`compile_count.py --setting fedtp_cifar10 --backends auto`), with XLA's GPU autotuning on (the
#      default) and off (`--xla_gpu_autotune_level=0`): programs, compile seconds, round seconds (the rounds
#      finished in 80 s each).
# Needs jax with CUDA (torch with CUDA for the torch rows) and CIFAR-10 where JAXFL_DATA_DIR points (part 2).
# The working tree and CIFAR-10 together exceed what a call carries (64 MiB), so the copy keeps the whole training
# split and 500 test images a class (clients' test sets of 375-500 images instead of 500; compile counts and round
# times do not depend on it):
#
#   mkdir -p runs/device_data/cifar10 && python -c 'import numpy as np; t = np.load("../shared/data/cifar10/cifar10_test.npz"); \
#     i = np.sort(np.concatenate([np.flatnonzero(t["labels"] == c)[:500] for c in range(10)])); \
#     np.savez_compressed("runs/device_data/cifar10/cifar10_test.npz", images=t["images"][i], labels=t["labels"][i])'
#   cp ../shared/data/cifar10/cifar10_train.npz runs/device_data/cifar10/
#   # device tool: carry ["runs/device_data"], timeout_s 600, command (the copy's git metadata can be older than
#   # its files: name the commit, `git rev-parse --short HEAD` here, with a clean working tree):
#   PYTHON=python3 COMMIT=<commit> JAXFL_DATA_DIR=$PWD/runs/device_data bash benchmarks/gpu_session.sh "$OUT"
#   SMOKE=1 PYTHON=.venv/bin/python JAXFL_DATA_DIR=../shared/data bash benchmarks/gpu_session.sh /tmp/gpu_smoke  # any CPU
#
# Results: OUT/env.txt (device, versions, commit), OUT/lanes/ (results.json, results.md),
# OUT/command_buffer_{default,while}.json, OUT/vit_compile.json, OUT/fedtp_compile_autotune_{default,0}.json,
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

# XLA_FLAGS with FLAGS added, no stray blank: XLA reads a value that is one word without "--" as a file name
# (XLA_FLAGS=" " fails every program)
xla_flags() { echo "${XLA_FLAGS:-}${XLA_FLAGS:+${1:+ }}$1"; }

# XLA's command buffers: its default kinds, and those with CONDITIONAL and WHILE added
COMMAND_BUFFERS=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE
command_buffers() {  # PLAN ROUNDS LIMIT_S
  for cb in default while; do
    flags=$([ $cb = default ] || echo "--xla_gpu_enable_command_buffer=$COMMAND_BUFFERS")
    XLA_FLAGS="$(xla_flags "$flags")" timeout "$3" $PY benchmarks/throughput.py --small --plan "$1" \
      --runners stacked/vmap/K1,stacked/vmap/K10 --k 10 --median 60 --sigma 0.8 --rounds "$2" \
      --json "$OUT/command_buffer_$cb.json"
    echo "command buffers ($cb): rc $?"
  done
}

if [ -n "${SMOKE:-}" ]; then
  # tiny versions of every part: checks the commands and their outputs, not the device
  timeout 900 $PY benchmarks/gpu_suite.py --out "$OUT/lanes" --smoke
  command_buffers logreg:100:20 1 600
  timeout 600 $PY benchmarks/vit_compile.py --depth 2 --clients 2 --steps 1 --reps 1 --json "$OUT/vit_compile.json"
  timeout 900 $PY benchmarks/compile_count.py --setting fedtp_cifar10 --backends auto --rounds 2 \
    --out "$OUT/fedtp_compile.json" --model vit_tiny --local-epochs 1
  # a failed workload is a row, not an exit status: the smoke fails unless every part wrote its results
  for f in lanes/results.json command_buffer_default.json command_buffer_while.json vit_compile.json \
           fedtp_compile.json; do
    [ -s "$OUT/$f" ] || { echo "smoke: $f missing"; exit 1; }
  done
  if grep -l '"error"' "$OUT"/command_buffer_*.json "$OUT/lanes/results.json"; then
    echo "smoke: a workload failed (above)"; exit 1
  fi
  echo "smoke: every part wrote its results"
else
  timeout 200 $PY benchmarks/gpu_suite.py --out "$OUT/lanes" --lanes --budget-s 185
  echo "lanes: rc $?"
  command_buffers 2nn:1000:1000,logreg:1000:1000 3 60
  timeout 75 $PY benchmarks/vit_compile.py --depth 8 --clients 5 --steps 4 --reps 3 --json "$OUT/vit_compile.json"
  echo "vit compile: rc $?"
  for level in default 0; do  # XLA's GPU autotuning on (its default) and off: compile seconds against round time
    flags=$([ $level = default ] || echo "--xla_gpu_autotune_level=$level")
    XLA_FLAGS="$(xla_flags "$flags")" timeout 95 $PY benchmarks/compile_count.py --setting fedtp_cifar10 \
      --backends auto --rounds 40 --timeout-s 80 --out "$OUT/fedtp_compile_autotune_$level.json"
    echo "fedtp compile (autotune $level): rc $?"
  done
fi
