#!/usr/bin/env bash
# Runs on the lent GPU machine (see scripts/pack-device.sh; pack at least KCPP_PACK_BINS="moe_tests
# kcpp_package_tests" with KCPP_DEVICE_PYTHON for bench/moe.py): the moe package's tests, then
# bench/moe.py.  Results go to $OUT; the summary lines to stdout.
#   scripts/device-moe.sh tests                 the tests only
#   scripts/device-moe.sh quick [bench args]    the tests, then kcpp's rows without the peers, with the
#                                               profile (about 25-60 s of bench at Qwen3's dims)
#   scripts/device-moe.sh full [bench args]     the tests, then the peers too (Liger needs
#                                               LIGER_SRC, e.g. .anchors/src: 200-300 s at Qwen3's dims)
# e.g. scripts/device-moe.sh quick --configs qwen3 --gemm "auto,auto:KCPP_MOE_SM90=0"
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
mode="${1:-tests}"
shift || true
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels" KCPP_FIXTURES_DIR="$PWD/tests/fixtures" PYTHONPATH="$PWD/.devlibs/python"
export KCPP_EXAMPLE_PACKAGE_DIR="$PWD/.devlibs/kernels/example" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "== moe_tests"
.devlibs/bin/moe_tests > "$OUT/moe_tests.log" 2>&1
echo "rc=$?"
grep -E "^\[  PASSED|^\[  FAILED" "$OUT/moe_tests.log" | head -20
if [ -x .devlibs/bin/kcpp_package_tests ]; then
  echo "== kcpp_package_tests (moe)"
  .devlibs/bin/kcpp_package_tests --gtest_filter='*Moe*' > "$OUT/moe_package_tests.log" 2>&1
  echo "rc=$?"
  grep -E "^\[  PASSED|^\[  FAILED" "$OUT/moe_package_tests.log" | head -10
fi
[ "$mode" = tests ] && exit 0
lib=$(find .devlibs/kernels/moe/build -name libmoe.so -path "*kcpp1-cu*" | head -n 1)
extra=()
[ "$mode" = quick ] && extra=(--no-peers --profile)
echo "== bench/moe.py ${extra[*]} $*"
timeout 420 python3 bench/moe.py "$lib" "${extra[@]}" "$@" > "$OUT/bench_moe.log" 2>&1
echo "rc=$?"
grep -E "^profile.*: [0-9.]+ ms of kernels|^[A-Z].* (tokens|kcpp|liger|transformers|dense)" "$OUT/bench_moe.log" | cut -c1-170 | head -80
