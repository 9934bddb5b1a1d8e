#!/usr/bin/env bash
# The main job's figure, repeated: runs `kcpp train` N times (CPU unless the arguments say otherwise)
# and prints each run's tokens/s with the reference layers and with the kernels, their ratio, and how
# far each ratio lies from the median of the ratios.  Issue 21's bar: five runs within +-10%.
# Usage: bench/main_job_steadiness.sh [runs] [kcpp train arguments]   (KCPP: the kcpp binary)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
shift || true
kcpp="${KCPP:-build/release/bin/kcpp}"
[ "$#" -gt 0 ] || set -- --device cpu
ratios=()
for i in $(seq 1 "$runs"); do
  out=$("$kcpp" train "$@" 2>&1)
  ref=$(awk '$1 == "reference" && NF == 5 { print $2 }' <<<"$out")
  ker=$(awk '$1 == "kernels" && NF == 5 { print $2 }' <<<"$out")
  [ -n "$ref" ] && [ -n "$ker" ] || { echo "run $i: no reference / kernels row in kcpp train's output:"; echo "$out" | tail -5; exit 1; }
  ratio=$(awk -v r="$ref" -v k="$ker" 'BEGIN { printf "%.3f", k / r }')
  ratios+=("$ratio")
  echo "run $i: reference $ref tokens/s, kernels $ker tokens/s, ratio $ratio"
done
printf '%s\n' "${ratios[@]}" | sort -g | awk '{ r[NR] = $1 } END {
  m = (NR % 2) ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2
  printf "median ratio %.3f, runs from %+.1f%% to %+.1f%% of it\n", m, 100 * (r[1] / m - 1), 100 * (r[NR] / m - 1) }'
