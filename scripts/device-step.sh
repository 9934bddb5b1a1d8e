#!/usr/bin/env bash
# Runs on the lent GPU machine (carry .devlibs, and .anchors for Transformers' step): the training
# step's figures in one call, so that the ratios hold — the AdamW step against the copy bandwidth,
# `kcpp bench --step` (the step's time by slot and GEMM shape against each one's floor), the step of
# kcpp_bench_train, and Transformers' step with Liger's kernels (plain cross-entropy) and with
# torch.compile (.anchors/e2e.py: ../shared/anchors, with Liger's source under .anchors/src).
# KCPP_FLCE_SWEEP=1 adds the fused linear cross-entropy's chunk sweep; KCPP_E2E names e2e.py's
# configurations (default "liger_ce compile"; empty: none).
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels" KCPP_FIXTURES_DIR="$PWD/tests/fixtures"
echo "== tests of the step's parts"
.devlibs/bin/kcpp_tests --gtest_brief=1 --gtest_filter='AdamW*:Profile*:Training*:CausalLM*' 2>&1 | tail -n 5
echo "== AdamW"
.devlibs/bin/kcpp_bench_train --only adamw 2>&1 | tee "$OUT/adamw.txt"
echo "== kcpp bench --step"
.devlibs/bin/kcpp bench --step --json "$OUT/step.json" > "$OUT/step.txt" 2>&1
grep -vE "^\s+(liger|flash_attn|reference)" "$OUT/step.txt" | head -n 60
echo "== kcpp_bench_train"
.devlibs/bin/kcpp_bench_train --only kcpp --steps 5 2>&1 | tee "$OUT/train.txt" | tail -n 1
if [ -n "${KCPP_FLCE_SWEEP:-}" ]; then
  echo "== fused linear cross-entropy"
  .devlibs/bin/kcpp_bench_kernels --only flce --sweep 2>&1 | tee "$OUT/flce.txt" | grep -E "flce"
fi
if [ -f .anchors/e2e.py ]; then
  echo "== Transformers' step (e2e.py)"
  for c in ${KCPP_E2E-liger_ce compile}; do PYTHONUNBUFFERED=1 timeout 200 python3 .anchors/e2e.py "$c" 2>&1 | grep -E "tok/s|Error|error" ; done
fi
