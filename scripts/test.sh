#!/usr/bin/env bash
# The test command: installs dependencies, builds (CUDA code included where nvcc exists, so a CUDA
# compile error fails here), and runs every test through CTest.  GPU tests run on a machine with a
# GPU and print "skipped: no CUDA device" elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/python-env.sh  # build/pyenv: nanobind for the Python package, torch + transformers for kcpp.torch's tests
scripts/build.sh release
ctest --preset release -j "$(nproc)"
