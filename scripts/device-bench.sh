#!/usr/bin/env bash
# Runs on the GPU machine: the kernel packages' tests, then our kernel benchmark, the anchors
# (PyTorch eager, torch.compile and Liger-Kernel, from an anchors.py and Liger's source placed in
# the git-ignored .anchors/ when present; bench/RESULTS.md says what they measure) and our
# benchmark again, all in one call so that the ratios hold.  Carry .devlibs and .anchors.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels"  # bench_activation loads the built package
export KCPP_FIXTURES_DIR="$PWD/tests/fixtures"
echo "== kernel tests"
for t in liger_tests kcpp_package_tests; do
  .devlibs/bin/$t --gtest_brief=1 2>&1 | tee "$OUT/$t.txt" | tail -n 25
done
KCPP_HUB_FIXTURES="$PWD/.devlibs/fixtures" python3 -m unittest discover -s python/tests 2>&1 | tail -n 3
echo "== kcpp kernels (1)"
.devlibs/bin/kcpp_bench_kernels --json "$OUT/kcpp_bench_1.json" ${KCPP_SWEEP:+--sweep} ${KCPP_BENCH_ONLY:+--only $KCPP_BENCH_ONLY}
if [ "${KCPP_ANCHORS:-1}" = 1 ] && [ -f .anchors/anchors.py ]; then
  echo "== anchors"
  anchors=.anchors/anchors.py
  if [ -n "${KCPP_ANCHORS_SKIP:-}" ]; then  # e.g. "flce attention e2e": a copy without those sections
    anchors=.anchors/anchors_subset.py  # beside anchors.py: it finds Liger's sources from there
    python3 - "$KCPP_ANCHORS_SKIP" > "$anchors" <<'PY'
import re, sys
src = open(".anchors/anchors.py").read()
for name in sys.argv[1].split():
    src = re.sub(r'\("%s", %s\),?\s*' % (name, name), "", src)
print(src)
PY
  fi
  PYTHONUNBUFFERED=1 timeout 420 python3 "$anchors" "${KCPP_ANCHORS_ARGS:-}" 2>&1 | grep -vE "^\s+(File|\^|~)" | tee "$OUT/anchors.txt" | grep -E "copy|gemm|rmsnorm|swiglu|rope|ce fwd|flce|took|!!"
fi
if [ "${KCPP_ANCHORS:-1}" = 1 ]; then
  # `all`: anchors.py's ops too, under the deep-flush timer (its do_bench figures of torch.compile's
  # forward + backward are host-bound on the lent machine: bench/RESULTS.md).
  # KCPP_EXTRA_ARGS picks sections (e.g. "activations geglu"); `all` compiles 15 functions.
  echo "== eager and torch.compile under the deep-flush timer (bench/anchors_extra.py ${KCPP_EXTRA_ARGS:-all})"
  PYTHONUNBUFFERED=1 timeout 540 python3 bench/anchors_extra.py ${KCPP_EXTRA_ARGS:-all} 2>&1 | tee "$OUT/anchors_extra.txt"
fi
if [ "${KCPP_ANCHORS:-1}" = 1 ] && [ -d .anchors/src ]; then
  echo "== kcpp and Liger under one timer (bench/anchors_kcpp.py, through python/kcpp.py)"
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/anchors_kcpp.py 2>&1 | tee "$OUT/anchors_kcpp.txt"
fi
echo "== kcpp kernels (2)"
.devlibs/bin/kcpp_bench_kernels --json "$OUT/kcpp_bench_2.json" ${KCPP_BENCH_ONLY:+--only $KCPP_BENCH_ONLY}
