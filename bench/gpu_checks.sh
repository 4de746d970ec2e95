#!/usr/bin/env bash
# The GPU tests and GPU figures in one call, on a machine with one CUDA device.
#
# Runs, in this order: the tests marked `gpu` (tests/test_torch_gpu.py: placement, the four
# precisions, checkpoints and check-resume on the device, no host sync per step) and the monitor's
# device-scalar tests; then bench/torch_loop.py (a small MLP and ResNet-18 through TorchModel,
# no plugins and six plugins, against a raw loop and Lightning, in one run). Output and JSON go to
# $OUT (default /tmp/epochal-gpu). Where a folder .whl holds wheels (epochal, its plugins and the
# dependencies the machine lacks), they are installed into /tmp/site first, without the network.
# Usage: bash bench/gpu_checks.sh   (BENCH_* variables as bench/torch_loop.py documents them)
set -u
OUT=${OUT:-/tmp/epochal-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee "$OUT/device.txt"
$PY -c "import torch, epochal; print('torch', torch.__version__, torch.cuda.get_device_name(), 'epochal', epochal.__file__)" 2>&1 | tee -a "$OUT/device.txt"
start=$SECONDS
timeout "${GPU_TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider tests/test_torch_gpu.py \
    plugins/epochal-monitor/tests/test_monitor_device_scalars.py 2>&1 | tee "$OUT/tests.log" | tail -25
echo "tests: $((SECONDS - start)) s"
start=$SECONDS
BENCH_JSON="$OUT/torch_loop.json" timeout "${GPU_BENCH_TIMEOUT:-300}" $PY bench/torch_loop.py 2>&1 | tee "$OUT/torch_loop.log"
echo "torch_loop: $((SECONDS - start)) s"
