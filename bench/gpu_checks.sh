#!/usr/bin/env bash
# The GPU tests and GPU figures in one call, on a machine with one CUDA device.
#
# Runs, in this order: the tests marked `gpu` (tests/test_torch_gpu.py: placement, the four
# precisions, checkpoints and check-resume on the device, no host sync per step) and the monitor's
# device-scalar tests; then bench/torch_loop.py (a small MLP and ResNet-18 through TorchModel,
# no plugins and six plugins, against a raw loop and Lightning, in one run). Output and JSON go to
# $OUT (default /tmp/epochal-gpu). Where a folder .whl holds wheels (epochal, its plugins and the
# dependencies the machine lacks: bench/gpu_wheels.sh builds it), they are installed into
# /tmp/site first, without the network; the run stops if zlib-ng, stevedore or pydantic is missing.
# With GPU_SPLIT=1 the bench runs four times: both models with epochs of 300 steps and with epochs
# ten (MLP) or three (ResNet-18) times longer, which splits per-step from per-epoch costs; between
# them run the tests and bench/torch_checkpoint.py on the GPU at a small MLP's and ResNet-18's
# state sizes (8 and 96 MB: the save's device-to-host copy split from its write).
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
# the dependencies whose absence would change the figures (zlib-ng: the checkpoint's CRC-32)
$PY -c "import zlib_ng, stevedore, pydantic" 2>&1 || {
    echo "missing dependencies: build .whl with bench/gpu_wheels.sh" >&2
    exit 1
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee "$OUT/device.txt"
$PY -c "import torch, epochal; print('torch', torch.__version__, torch.cuda.get_device_name(), 'epochal', epochal.__file__)" 2>&1 | tee -a "$OUT/device.txt"
tests() {
    local start=$SECONDS
    timeout "${GPU_TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider tests/test_torch_gpu.py \
        plugins/epochal-monitor/tests/test_monitor_device_scalars.py 2>&1 | tee "$OUT/tests.log" | tail -25
    echo "tests: $((SECONDS - start)) s"
}
bench() {  # bench NAME [VAR=value...]: one run of bench/torch_loop.py, its figures in $OUT/NAME.json
    local name=$1 start=$SECONDS
    shift
    env "$@" BENCH_JSON="$OUT/$name.json" timeout "${GPU_BENCH_TIMEOUT:-300}" $PY bench/torch_loop.py 2>&1 \
        | tee "$OUT/$name.log"
    echo "$name: $((SECONDS - start)) s"
}
if [ "${GPU_SPLIT:-0}" = 1 ]; then
    # per step or per epoch? The same cases with epochs of 300 steps and of 3,000 (MLP) / 1,000
    # (ResNet-18) steps, no Lightning (its figures are in bench/README.md); then the tests.
    cases=raw,bare,six,async
    bench mlp_300 BENCH_MODELS=mlp BENCH_STEPS=300 BENCH_EPOCHS=3 BENCH_REPEATS=11 BENCH_CASES=$cases
    start=$SECONDS
    (cd bench && timeout 120 $PY torch_checkpoint.py --device cuda --sizes 8,96 --rounds 5 --profile-load --dir /tmp) 2>&1 \
        | tee "$OUT/checkpoint.log"
    echo "checkpoint: $((SECONDS - start)) s"
    tests
    bench resnet_300 BENCH_MODELS=resnet18 BENCH_STEPS=300 BENCH_EPOCHS=3 BENCH_REPEATS=3 BENCH_CASES=$cases
    bench mlp_3000 BENCH_MODELS=mlp BENCH_STEPS=3000 BENCH_EPOCHS=2 BENCH_REPEATS=3 BENCH_CASES=$cases
    bench resnet_1000 BENCH_MODELS=resnet18 BENCH_STEPS=1000 BENCH_EPOCHS=2 BENCH_REPEATS=2 \
        BENCH_CASES=raw,six,async
else
    tests
    bench torch_loop
fi
