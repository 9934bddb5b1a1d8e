#!/usr/bin/env bash
# The main job: build, report the platform, then `kcpp train` — a small Llama-style model trained on
# the embedded corpus with the reference layers and then with this build's kernels, side by side,
# and a sample of its text (on the GPU if there is one, else the CPU).  Arguments go to kcpp train.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh release
build/release/bin/kcpp info
build/release/bin/kcpp train "$@"
