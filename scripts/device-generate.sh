#!/usr/bin/env bash
# Runs on the lent GPU machine (carry .devlibs): decoding in one call, so that the ratios hold — the
# generation tests on the GPU, then bench/generate.py: `kcpp generate` beside Transformers' eager and
# static-cache (compiled) generate() on the same random weights, at Qwen3-0.6B and Llama-3.2-1B
# dimensions, with the decoding-attention kernel beside PyTorch SDPA first.  KCPP_GEN_ARGS passes
# options to bench/generate.py (default: batches 1, 8 and 32); KCPP_SKIP_DECODE_ATTN=1 skips the
# decoding-attention comparison.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels" KCPP_FIXTURES_DIR="$PWD/tests/fixtures" PYTHONUNBUFFERED=1
echo "== tests"
.devlibs/bin/kcpp_tests --gtest_brief=1 \
  --gtest_filter='*Matmul*:*Sampling*:*Views*:*OpsStrided*:*Generation*:*ArgmaxChecked*:*DecodeAttention*:*DecodeFused*:Tensor.*:*PrivatePool*:Transformers/Families.*' 2>&1 | tail -n 12
if [ "${KCPP_SKIP_DECODE_ATTN:-0}" != 1 ]; then
  echo "== decoding attention: kcpp beside PyTorch SDPA"
  .devlibs/bin/kcpp_bench_kernels --only decode_attention 2>&1 | grep -E "copy d2d 2GiB|decode_attn"
  timeout 120 python3 bench/decode_attention.py 2>&1 | grep -vE "warn|Warn|timed\("
fi
echo "== decode projections: kcpp (gemv.cu) beside F.linear (cuBLAS)"
.devlibs/bin/kcpp_bench_kernels --only gemv 2>&1 | grep -E "copy d2d 2GiB|gemv"
(cd bench && timeout 120 python3 gemv.py 2>&1 | grep -vE "warn|Warn")
echo "== bench/generate.py"
timeout 540 python3 bench/generate.py --kcpp .devlibs/bin/kcpp ${KCPP_GEN_ARGS:-} 2>&1 | grep -vE "deprecated|warn" | tail -n 20
