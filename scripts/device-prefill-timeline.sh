#!/usr/bin/env bash
# Runs on the lent GPU machine (carry .devlibs): where a prefill's time goes, kernel by kernel, as it
# really runs (warm caches, programmatic dependent launch on; unlike device-decode-profile.sh's Nsight
# Compute, which serializes the kernels and flushes the caches).  One prompt of KCPP_PREFILL_TOKENS
# tokens (default 2048) at a model's dimensions (random bf16 weights) goes to its first token twice
# (`kcpp generate --warmup --max-new-tokens 1`) under tools/kernel_trace's CUPTI library; the second
# prefill's kernels are summed by name, with the wall time from its first kernel's start to its last
# kernel's end, and the host's CUDA calls over the same span (from the first prefill's last kernel)
# that took longest, which say where the host held the GPU up.  KCPP_PROFILE_MODEL picks
# bench/generate.py's model key (qwen3, llama).  Pack libkcpp_kernel_trace.so with the binaries
# (KCPP_PACK_BINS).
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels"
model=${KCPP_PROFILE_MODEL:-qwen3} tokens=${KCPP_PREFILL_TOKENS:-2048}
folder=$(random_model_folder "$model")
python3 -c "print(','.join(str(7 + (i * 7919) % 50000) for i in range($tokens)))" > "$OUT/prompt-$model.txt"
cupti_lib=$(find / -name 'libcupti.so.13' -not -path '/proc/*' 2>/dev/null | head -n 1)
[ -n "$cupti_lib" ] || { echo "no libcupti.so.13 on this machine"; exit 1; }
# KCPP_TIMELINE_VARIANTS="name:ENV=V+ENV2=V2,...": one run a variant (default: one run as is).
for variant in $(echo "${KCPP_TIMELINE_VARIANTS:-default:KCPP_TIMELINE=1}" | tr ',' ' '); do
tag=${variant%%:*}
rep="$OUT/prefill-$model-$tokens-$tag.tsv"
env $(echo "${variant#*:}" | tr '+' ' ') \
  LD_LIBRARY_PATH="$(dirname "$cupti_lib"):$LD_LIBRARY_PATH" CUDA_INJECTION64_PATH="$PWD/.devlibs/bin/libkcpp_kernel_trace.so" \
  KCPP_TRACE_OUT="$rep" KCPP_TRACE_API=1 timeout 200 .devlibs/bin/kcpp generate --model "$folder" --prompt-ids-file "$OUT/prompt-$model.txt" \
  --max-new-tokens 1 --ignore-eos --dtype bf16 --warmup > "$OUT/prefill-generate-$model-$tag.txt" 2>&1
echo "== $tag: trace rc $? ($(wc -l < "$rep") kernels); $(grep -i 'first token' "$OUT/prefill-generate-$model-$tag.txt" | head -n 1 | cut -c1-100)"
python3 - "$rep" "$model" "$tokens" <<'PY'
import collections, sys
sys.path.insert(0, "scripts")
import kernel_trace
rows = [(start, end, name) for start, end, _stream, _graph, name in kernel_trace.read(sys.argv[1], 100)]
rows.sort()
# The two prefills run the same kernels: the second is the last half.
run = rows[len(rows) // 2:]
wall = (run[-1][1] - run[0][0]) / 1e3
dur, count, gaps = collections.defaultdict(float), collections.Counter(), 0.0
for i, (s, e, n) in enumerate(run):
    dur[n] += (e - s) / 1e3
    count[n] += 1
    if i:
        gaps += max(0, s - run[i - 1][1]) / 1e3
busy = sum(dur.values())
print(f"{sys.argv[2]} prefill {sys.argv[3]}: {len(run)} kernels, {wall:.1f} us first start to last end, "
      f"kernels {busy:.1f} us, idle {gaps:.1f} us")
print("        us  launches  kernel")
for n in sorted(dur, key=lambda n: -dur[n]):
    print(f"  {dur[n]:8.1f}  {count[n]:8d}  {n}")
try:
    calls = [l.rstrip("\n").split("\t", 4) for l in open(sys.argv[1] + ".api.tsv")]
except OSError:
    sys.exit()
lo, hi = rows[len(rows) // 2 - 1][1], run[-1][1]
host, n_calls = collections.defaultdict(float), collections.Counter()
for s, e, _st, _g, name in calls:
    s, e = int(s), int(e)
    if lo <= s <= hi and name.startswith("api:"):
        host[name[4:]] += (e - s) / 1e3
        n_calls[name[4:]] += 1
print("host CUDA calls over the second prefill (us, calls):")
for n in sorted(host, key=lambda n: -host[n])[:12]:
    print(f"  {host[n]:8.1f}  {n_calls[n]:6d}  {n}")
copies = [(int(s), int(e), name) for s, e, _st, _g, name in calls if name.startswith("memcpy:") and lo <= int(s) <= hi]
print(f"copies on the GPU: {len(copies)}: " + ", ".join(c[2][7:] for c in copies[:8]))
PY
done
