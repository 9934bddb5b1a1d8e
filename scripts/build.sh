#!/usr/bin/env bash
# Configures and builds with a CMake preset (default: release, CUDA when nvcc is found).
# Usage: scripts/build.sh [preset]
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-release}"
# nvcc is usually outside the PATH; CMake finds it there too, this only makes `nvcc` visible to it.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
