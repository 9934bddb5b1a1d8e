#!/usr/bin/env bash
# Runs on the lent GPU machine (carry .devlibs; pack at least KCPP_PACK_BINS="kcpp kcpp_tests" with
# KCPP_DEVICE_PYTHON for bench/generate.py): the state-space models' decoding in one call, so that the
# ratios hold — the fused step's tests (ops/nn/mamba_decode.h against the f64 oracle, the models'
# fused steps against the slots'; with kcpp_package_tests packed, the kernelized models' batched
# generation as a CUDA graph), then `kcpp generate` at Mamba-1.4B and Falcon-Mamba-7B dimensions
# (random bf16 weights made on the GPU, no Transformers rows): the slots' step as a CUDA graph beside
# the fused one (the default; the slots' with KCPP_MAMBA_DECODE_FUSED=0), at the batches KCPP_MAMBA_BATCHES names (default 1,4).
# KCPP_GEN_ARGS adds options to bench/generate.py.  About 3 minutes on an H100.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels" KCPP_FIXTURES_DIR="$PWD/tests/fixtures" PYTHONUNBUFFERED=1
echo "== tests"
timeout 120 .devlibs/bin/kcpp_tests --gtest_filter='*DecodeFused*:*MambaFamilies*' > "$OUT/mamba-tests.log" 2>&1
echo "rc $?"
grep -E "^\[  PASSED|^\[  FAILED|Failure|Expected|Which is|rel_l2" "$OUT/mamba-tests.log" | head -n 30
if [ -x .devlibs/bin/kcpp_package_tests ]; then  # kernelized, batched generation as a CUDA graph
  timeout 120 .devlibs/bin/kcpp_package_tests --gtest_filter='*MambaKernelized*' > "$OUT/mamba-package-tests.log" 2>&1
  echo "rc $?"
  grep -E "^\[  PASSED|^\[  FAILED|Failure|Expected|Which is" "$OUT/mamba-package-tests.log" | head -n 20
fi
echo "== bench/generate.py"
timeout 420 python3 bench/generate.py --kcpp .devlibs/bin/kcpp --models mamba,falcon_mamba --batches "${KCPP_MAMBA_BATCHES:-1,4}" \
  --new 128 --prefill 0 --skip-parity --skip-hf --variants slots:KCPP_MAMBA_DECODE_FUSED=0 ${KCPP_GEN_ARGS:-} 2>&1 |
  grep -vE "deprecated|warn" | tail -n 12
