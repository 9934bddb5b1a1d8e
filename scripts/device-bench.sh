#!/usr/bin/env bash
# Runs on the lent GPU machine: the kernel packages' tests, then our kernel benchmark, the anchors
# (PyTorch eager, torch.compile, Liger from .anchors/, see ../shared/anchors/README.md) and our
# benchmark again, all in one call so that the ratios hold.  Carry .devlibs and .anchors.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== kernel tests"
.devlibs/bin/liger_tests --gtest_brief=1 2>&1 | tee "$OUT/liger_tests.txt" | tail -n 25
echo "== kcpp kernels (1)"
.devlibs/bin/kcpp_bench_kernels --json "$OUT/kcpp_bench_1.json" ${KCPP_SWEEP:+--sweep}
if [ "${KCPP_ANCHORS:-1}" = 1 ] && [ -f .anchors/anchors.py ]; then
  echo "== anchors"
  PYTHONUNBUFFERED=1 timeout 420 python3 .anchors/anchors.py "${KCPP_ANCHORS_ARGS:-}" 2>&1 | grep -vE "^\s+(File|\^|~)" | tee "$OUT/anchors.txt" | grep -E "copy|gemm|rmsnorm|swiglu|rope|ce fwd|took|!!"
fi
echo "== kcpp kernels (2)"
.devlibs/bin/kcpp_bench_kernels --json "$OUT/kcpp_bench_2.json"
