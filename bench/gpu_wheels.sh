#!/usr/bin/env bash
# Builds .whl/: the wheels bench/gpu_checks.sh installs on a GPU machine that has no network.
#
# epochal and its plugins (from this tree; mlflow's is left out: the machine lacks mlflow), and
# the runtime dependencies a machine with torch and Lightning usually lacks, for CPython 3.12 on
# manylinux x86-64: stevedore, pydantic (and its own), zlib-ng (without it the checkpoint's CRC-32
# falls back to zlib's, ~5x slower: checkpoint figures measured so are not epochal's) and
# safetensors (bench/torch_checkpoint.py). Pass the device's Python version as PYVER (3.12).
# Usage: bash bench/gpu_wheels.sh   then: run bash bench/gpu_checks.sh there, carrying .whl
set -eu
PYVER=${PYVER:-3.12}
PIP=${PIP:-python3 -m pip}
rm -rf .whl && mkdir .whl
for dist in . $(ls -d plugins/epochal-* | grep -v mlflow); do
    $PIP wheel -q --no-deps -w .whl "$dist"  # hatchling, the build backend, fetched by pip
done
$PIP download -q --only-binary=:all: --python-version "$PYVER" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d .whl stevedore pydantic zlib-ng safetensors
ls .whl
