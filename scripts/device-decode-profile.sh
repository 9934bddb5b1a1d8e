#!/usr/bin/env bash
# Runs on the lent GPU machine (carry .devlibs): where a decode step's time goes, kernel by kernel.
# Nsight Compute times every kernel of a short greedy generation at Qwen3-0.6B's dimensions (random
# weights, bf16, CUDA graphs off so that each launch is seen on its own), and the durations are summed
# by kernel name over the decode steps (the prefill's kernels are the first step's, left out).
# KCPP_PROFILE_MODEL picks bench/generate.py's model key (qwen3, llama); KCPP_PROFILE_BATCH the rows.
# KCPP_PROFILE_PREFILL=N profiles the prefill instead: one N-token prompt to its first token, every
# kernel summed.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels" KCPP_DECODE_GRAPHS=0
model=${KCPP_PROFILE_MODEL:-qwen3} rows=${KCPP_PROFILE_BATCH:-1} steps=4
folder=$(random_model_folder "$model")
prefill=${KCPP_PROFILE_PREFILL:-0}
[ "$prefill" -gt 0 ] && steps=1
ids=$(python3 -c "print(','.join(str(7 + i % 1000) for i in range(max($prefill, 16))))")
: > "$OUT/prompts.txt"
for _ in $(seq "$rows"); do echo "$ids" >> "$OUT/prompts.txt"; done
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
timeout 500 "$ncu" --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
  .devlibs/bin/kcpp generate --model "$folder" --prompt-ids-file "$OUT/prompts.txt" --max-new-tokens "$steps" \
  --ignore-eos --dtype bf16 > "$OUT/generate.txt" 2>&1
echo "ncu rc $?"
python3 - "$OUT/ncu.csv" "$steps" "$prefill" <<'PY'
import csv, collections, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
        if r.get("Metric Name") == "gpu__time_duration.sum"]
# The decode steps: everything after the prefill's lm_head-sized launches is hard to mark, so split
# the launch list into equal steps from the end (every decode step launches the same kernels).
steps = int(sys.argv[2]) - 1
per_step = None
names = [r["Kernel Name"] for r in rows]
if int(sys.argv[3]) > 0:  # the prefill: every kernel, one "step"
    per_step, steps = len(rows), 1
for n in range(1, 0 if per_step else len(rows) // steps + 1):
    tail = names[-n * steps:]
    if all(tail[i] == tail[i % n] for i in range(len(tail))):
        per_step = n
if not per_step:
    print(f"{len(rows)} kernels; no repeating decode step found"); sys.exit(0)
def us(r):
    v = float(r["Metric Value"].replace(",", ""))
    unit = r["Metric Unit"]  # Nsight Compute 2025 writes ns / us / ms, older versions nsecond / usecond / msecond
    return v / 1e3 if unit in ("ns", "nsecond") else v * 1e3 if unit in ("ms", "msecond") else v
sums, counts = collections.defaultdict(float), collections.Counter()
for r in rows[-per_step * steps:]:
    sums[r["Kernel Name"][:90]] += us(r) / steps
    counts[r["Kernel Name"][:90]] += 1
total = sum(sums.values())
print(f"{per_step} kernels a {'prefill' if int(sys.argv[3]) else 'decode step'}, {total:.1f} us of kernel time a step (launch gaps not counted)")
for name, t in sorted(sums.items(), key=lambda kv: -kv[1]):
    print(f"{t:9.1f} us {100 * t / total:5.1f}%  x{counts[name] // steps:<4d} {name}")
PY
