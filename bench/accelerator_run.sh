#!/usr/bin/env bash
# The accelerator measurement of docs/PERFORMANCE.md in one command, on a GPU (or TPU) host: the devices JAX sees,
# parity with transformers there (bench/parity_bench.py), then bench/extract_bench.py --accelerator (Qwen2.5-7B
# shape, layers 15-18, packed 2,048-token rows, the engine's attention kernel beside the materialised one), then
# bench/goodput_bench.py: a cold and a warm consume.py task at the 7B shape (18 layers, packed 2,048-token rows),
# phase by phase ("Goodput"). Figures go to stdout and to $OUT (or /tmp/accelerator-run). Python packages the host
# lacks travel as wheels in .whl/ (bench/device_wheels.sh fetches them) and are installed under /tmp/site first.
# Arguments go to extract_bench.py; $PARITY_ARGS to parity_bench.py and $GOODPUT_ARGS to goodput_bench.py (all
# default to the full shapes). $STEPS picks the steps (default "parity extract goodput"); the goodput step stops
# after $GOODPUT_TIMEOUT seconds (default 240) so that the whole stays within 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/accelerator-run}"
steps=" ${STEPS:-parity extract goodput} "
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
date -u +"date %Y-%m-%dT%H:%M:%SZ" | tee "$out/devices.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$out/devices.txt" || true
python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())' 2>&1 | tee -a "$out/devices.txt"
if [[ "$steps" == *" parity "* ]]; then
    # torch and JAX share the GPU in the parity run: JAX must not take 75% of it up front.
    read -r -a parity_args <<< "${PARITY_ARGS:-}"
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/parity_bench.py "${parity_args[@]}" 2>&1 | tee "$out/parity.txt"
fi
if [[ "$steps" == *" extract "* ]]; then
    python3 bench/extract_bench.py --accelerator --skip-cpu --json "$@" 2>&1 | tee "$out/extract_bench.txt"
fi
if [[ "$steps" == *" goodput "* ]]; then
    # A cold and a warm task start at the 7B shape, each a fresh consume.py with the default settings and one cache
    # directory for the pair; the model is a local directory here (the host reaches no bucket), so the weights
    # copy is not exercised: the CPU run of docs/PERFORMANCE.md measures it against a bucket.
    read -r -a goodput_args <<< "${GOODPUT_ARGS:---shape Qwen/Qwen2.5-7B --checkpoint-layers 18 --layers 18 --source local --rows 32 --max-seq-len 2048 --batch-size 8 --packing --tasks 2 --baseline 0}"
    if ! timeout "${GOODPUT_TIMEOUT:-240}" python3 bench/goodput_bench.py "${goodput_args[@]}" --json 2>&1 | tee "$out/goodput.txt"; then
        echo "goodput: stopped or failed (see $out/goodput.txt); the steps before it are complete" | tee -a "$out/goodput.txt"
    fi
fi
