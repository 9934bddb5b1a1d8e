#!/usr/bin/env bash
# Runs on the lent GPU machine (see scripts/pack-device.sh): platform report, the whole test suite,
# the ceilings, and PyTorch's own copy / GEMM figures in the same call as a cross-check.
# Results go to $OUT (the device tool brings them back).
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%F)"  # .git does not travel: pass KCPP_COMMIT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
echo "== kcpp info"
.devlibs/bin/kcpp info | tee "$OUT/info.txt"
.devlibs/bin/kcpp info --json > "$OUT/info.json"
echo "== tests"
export KCPP_EXAMPLE_PACKAGE_DIR="$PWD/.devlibs/kernels/example" KCPP_BINARY="$PWD/.devlibs/bin/kcpp"
export KCPP_EXAMPLE_ABI99_LIBRARY="$PWD/.devlibs/fixtures/libkcpp_fixture_abi99.so"
export KCPP_NO_SYMBOL_LIBRARY="$PWD/.devlibs/fixtures/libkcpp_fixture_no_symbol.so"
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels" KCPP_FIXTURES_DIR="$PWD/tests/fixtures"
for t in kcpp_tests liger_tests kcpp_package_tests kcpp_hub_tests; do
  echo "-- $t"
  .devlibs/bin/$t --gtest_brief=1 2>&1 | tee "$OUT/$t.txt" | tail -n 25
done
echo "== hub: the built example package on this machine (variant choice, verified load)"
.devlibs/bin/kcpp show "$PWD/.devlibs/kernels/example:SiLU"
KCPP_ALLOW_ALL_KERNELS=1 .devlibs/bin/kcpp verify "$PWD/.devlibs/kernels/example:SiLU"
echo "== ceilings"
.devlibs/bin/kcpp bench --ceilings --device cuda --json "$OUT/ceilings.json"
.devlibs/bin/kcpp bench --ceilings --device cuda --json "$OUT/ceilings2.json" | tail -n 3
echo "== torch cross-check (same call)"
python3 - <<'PY'
import torch, triton
n = 2 * 2**30
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
print(f"torch copy 2 GiB   {ms:8.3f} ms {2 * n / 1e9 / (ms / 1e3):8.1f} GB/s")
del a, b
for dt in (torch.bfloat16, torch.float32):
    m = 8192
    x = torch.randn(m, m, dtype=dt, device="cuda"); y = torch.randn(m, m, dtype=dt, device="cuda")
    ms = triton.testing.do_bench(lambda: x @ y, return_mode="median")
    print(f"torch gemm {str(dt)[6:]} 8192^3 {ms:8.3f} ms {2 * m**3 / 1e12 / (ms / 1e3):8.1f} TFLOP/s (tf32 {torch.backends.cuda.matmul.allow_tf32})")
PY
