#!/usr/bin/env bash
# Engine and kernel benchmarks on a lent accelerator (see benchmarks/device.py).
#
#   bash benchmarks/device.sh               # on the accelerator; a few minutes
#   bash benchmarks/device.sh --cpu-smoke   # toy sizes on any machine (checks the script)
#
# Runs from the source tree with only jax, flax and numpy installed. The report
# goes to stdout and to $OUT/device.txt when OUT is set. Stops itself after
# DEVICE_TIMEOUT seconds (default 540).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # the engine sizes its own KV pool
log=${OUT:+$OUT/device.txt}
timeout "${DEVICE_TIMEOUT:-540}" "$PY" -u -m benchmarks.device "$@" 2>&1 | tee ${log:-/dev/null}
