#!/usr/bin/env bash
# Runs on the lent GPU machine (carry .devlibs): where a decode step's time goes inside its CUDA graph.
# A greedy generation at a model's dimensions (random weights, bf16, the default path: CUDA graphs and
# programmatic dependent launch on) runs with tools/kernel_trace's CUPTI library injected, which
# records every kernel of every replayed graph (Nsight Systems cannot make a report on that machine).
# For the last decode steps it prints each kernel's mean duration and the mean gap before it (its
# start minus the previous kernel's end; negative where programmatic dependent launch overlaps the
# two), by kernel and in the launch order of one period, and the step's wall time.  Unlike
# device-decode-profile.sh (Nsight Compute: each kernel alone, caches flushed), these are the times
# the step really spends.  Pack libkcpp_kernel_trace.so with the binaries (KCPP_PACK_BINS).
# KCPP_PROFILE_MODEL picks bench/generate.py's model key (qwen3, llama); KCPP_PROFILE_BATCH the rows.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels"
model=${KCPP_PROFILE_MODEL:-qwen3} rows=${KCPP_PROFILE_BATCH:-1} steps=48
folder=$(random_model_folder "$model")
ids=$(python3 -c "print(','.join(str(7 + i % 1000) for i in range(16)))")
: > "$OUT/prompts.txt"
for _ in $(seq "$rows"); do echo "$ids" >> "$OUT/prompts.txt"; done
cupti_lib=$(find / -name 'libcupti.so.13' -not -path '/proc/*' 2>/dev/null | head -n 1)
[ -n "$cupti_lib" ] || { echo "no libcupti.so.13 on this machine"; exit 1; }
cupti=$(dirname "$cupti_lib")
rep="$OUT/timeline-$model-b$rows${KCPP_TIMELINE_TAG:-}.tsv"
LD_LIBRARY_PATH="$cupti:$LD_LIBRARY_PATH" CUDA_INJECTION64_PATH="$PWD/.devlibs/bin/libkcpp_kernel_trace.so" KCPP_TRACE_OUT="$rep" \
  timeout 300 .devlibs/bin/kcpp generate --model "$folder" --prompt-ids-file "$OUT/prompts.txt" --max-new-tokens "$steps" \
  --ignore-eos --dtype bf16 > "$OUT/generate-$model.txt" 2>&1
echo "trace rc $? ($(wc -l < "$rep") kernels)"
python3 - "$rep" "$model" <<'PY'
import collections, sys
sys.path.insert(0, "scripts")
import kernel_trace
rows = [(start, end, name) for start, end, _stream, _graph, name in kernel_trace.read(sys.argv[1], 90)]
names = [r[2] for r in rows]
# A decode step launches the same kernels in the same order: find the period from the end.
per = next((n for n in range(1, len(rows) // 8) if all(names[-1 - i] == names[-1 - i - n] for i in range(4 * n))), None)
if not per:
    sys.exit(f"{len(rows)} kernels; no repeating decode step found")
steps = 16
tail = rows[-per * steps:]
step_wall = (tail[-1][1] - tail[0][0]) / steps / 1e3
dur, gap = collections.defaultdict(float), collections.defaultdict(float)
order = []
for i, (s, e, n) in enumerate(tail):
    key = (i % per, n)
    dur[key] += (e - s) / steps / 1e3
    if i:
        gap[key] += (s - tail[i - 1][1]) / steps / 1e3
by_name_d, by_name_g, count = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
for (i, n), d in dur.items():
    by_name_d[n] += d
    by_name_g[n] += gap[(i, n)]
    count[n] += 1
busy = sum(by_name_d.values())
print(f"{sys.argv[2]}: {per} kernels a step, step {step_wall:.1f} us wall "
      f"({1e6 / step_wall:.0f} steps/s), kernels {busy:.1f} us, gaps {step_wall - busy:.1f} us")
print("   us a step   gap a step  launches  kernel")
for n in sorted(by_name_d, key=lambda n: -by_name_d[n]):
    print(f"  {by_name_d[n]:9.1f}  {by_name_g[n]:10.1f}  {count[n]:8d}  {n[:80]}")
# One layer in launch order: the kernels between the first two launches of the step's most frequent one.
print("one period, in order (first 16):")
for i in range(min(per, 16)):
    n = tail[i][2]
    print(f"  {dur[(i, n)]:7.2f} us  gap {gap[(i, n)]:6.2f}  {n[:80]}")
PY
