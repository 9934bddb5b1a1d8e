#!/usr/bin/env bash
# The main job (until the models land): build, report the platform, measure the ceilings that
# every benchmark figure is quoted against (the GPU if there is one, else the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh release
build/release/bin/kcpp info
build/release/bin/kcpp bench --ceilings "$@"
