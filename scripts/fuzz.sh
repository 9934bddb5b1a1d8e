#!/usr/bin/env bash
# Builds the fuzz targets of the parsers and of the kernel packages' entry points (preset `fuzz`: clang,
# libFuzzer, address and UB sanitizers; tests/fuzz/README.md) and runs each for SECONDS (default 20) from its seed corpus, as many at a
# time as there are cores.  Fails on any finding: a crash, a sanitizer report, an exception other
# than kcpp::Error, a broken property, an input slower than 10 s, an allocation or RSS over 2 GB.
# The input that failed is left in build/fuzz/findings/; replay it with
# `build/fuzz/bin/fuzz_TARGET build/fuzz/findings/TARGET-crash-...`.
# Usage: scripts/fuzz.sh [seconds] [target...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-20}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(reference manifest lockfile safetensors config tokenizer_load tokenizer_text kernel_config chat_template
                                  hub_api trust checkpoint training_data weight_index tokenizer_config serve_routing
                                  package_calls)

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "$(nproc)"

work=build/fuzz/run
rm -rf "$work" build/fuzz/findings
mkdir -p build/fuzz/findings
run_one() {
  local t="$1" dict="$work/$1.dict" max_len=4096
  case "$t" in reference) max_len=256 ;; package_calls) max_len=512 ;; tokenizer_text) max_len=2048 ;;
               manifest | tokenizer_load | tokenizer_config) max_len=8192 ;; esac
  mkdir -p "$work/corpus/$t"  # what the run adds; the seeds in the repository stay as they are
  cat tests/fuzz/dict/"$t".dict > "$dict"
  case "$t" in reference | tokenizer_text | chat_template | serve_routing | package_calls) ;; *) cat tests/fuzz/dict/json.dict >> "$dict" ;; esac
  if OMP_NUM_THREADS=1 UBSAN_OPTIONS=print_stacktrace=1 build/fuzz/bin/fuzz_"$t" -max_total_time="$seconds" \
      -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" -dict="$dict" -print_final_stats=1 \
      -artifact_prefix=build/fuzz/findings/"$t"- "$work/corpus/$t" tests/fuzz/corpus/"$t" >"$work/$t.log" 2>&1; then
    echo "fuzz $t: ok, $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$t.log" | grep -o '[0-9]*$') inputs in ${seconds}s"
  else
    echo "fuzz $t: FAILED (log: $work/$t.log)"
    tail -n 60 "$work/$t.log"
    return 1
  fi
}
export -f run_one
export seconds work
status=0
printf '%s\n' "${targets[@]}" | xargs -P "$(nproc)" -n 1 bash -c 'run_one "$1"' _ || status=1
[ $status -eq 0 ] && echo "fuzz: ${#targets[@]} targets, no findings" || echo "fuzz: findings in build/fuzz/findings/"
exit $status
