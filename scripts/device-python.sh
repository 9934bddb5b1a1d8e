#!/usr/bin/env bash
# Runs on the lent GPU machine: the Python bridge (kcpp.torch) with the machine's torch and
# Transformers, in one call so that the ratios hold — python/tests on the GPU, bench/hf_bridge.py's
# parity at real dimensions, and the training step kernelized by kcpp beside Transformers' own
# configurations (.anchors/e2e.py, from ../shared/anchors, Liger's source under .anchors/src).
# Pack first with the extension for the machine's Python:
#   KCPP_DEVICE_PYTHON=<a Python 3.12 with nanobind> scripts/pack-device.sh release
# and carry .devlibs and .anchors.  KCPP_STEPS names hf_bridge.py's step configurations (default all),
# KCPP_E2E e2e.py's (default "liger_ce liger compile"); KCPP_PY_TESTS=0 skips the tests.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export PYTHONPATH="$PWD/.devlibs/python" KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels" PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, kcpp; print('torch', torch.__version__, 'transformers', transformers.__version__, 'kcpp._core', kcpp._core is not None)"
if [ "${KCPP_PY_TESTS:-1}" != 0 ]; then
  echo "== python/tests"
  KCPP_REQUIRE_CORE=1 KCPP_REQUIRE_TORCH=1 KCPP_HUB_FIXTURES="$PWD/.devlibs/fixtures" \
    timeout 300 python3 -m unittest discover -s python/tests -v > "$OUT/python-tests.txt" 2>&1
  echo "rc $?"
  grep -E "^(Ran|OK|FAILED)|(ERROR|FAIL):|skipped '.*(CUDA|cuda)" "$OUT/python-tests.txt" | head -n 40
fi
echo "== parity (bench/hf_bridge.py parity)"
timeout 240 python3 bench/hf_bridge.py parity 2>&1 | grep -vE "deprecated|^\s*$" | tail -n 20
echo "== the training step: kcpp.torch (bench/hf_bridge.py) and Transformers' configurations (e2e.py)"
for c in ${KCPP_STEPS-kcpp kcpp_ce kcpp_compile}; do
  timeout 200 python3 bench/hf_bridge.py step "$c" 2>&1 | grep -E "tok/s|calls:|Error|error" | head -n 8
done
if [ -f .anchors/e2e.py ]; then
  for c in ${KCPP_E2E-liger_ce liger compile}; do
    timeout 200 python3 .anchors/e2e.py "$c" 2>&1 | grep -E "tok/s|Error|error"
  done
fi
