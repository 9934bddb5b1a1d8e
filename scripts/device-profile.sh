#!/usr/bin/env bash
# On the lent GPU: Nsight Compute figures of chosen kernel launches, ours and the anchors' side by
# side, as one table (and the SASS of each kernel, for reading).  --clock-control none: the card's
# clocks are left as they are.  Carry .devlibs (and .anchors for Liger's kernels).
#
#   scripts/device-profile.sh LABEL 'COMMAND' 'KERNEL REGEX' [LAUNCHES TO SKIP] [LABEL ...]
#
# The regex is matched against the mangled name (stable; what ptxas -v prints), e.g.
# 'forward_registersI13__nv_bfloat16Li8ELi2ELb0ELb1E'; Triton kernels by their plain name.
# Each LABEL's raw figures (ncu_LABEL.csv) and SASS (sass_LABEL.txt: cuobjdump of our benchmark binary or
# of the Triton cubin that holds it) end up in $OUT/profile.tar.xz.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
export KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || find / -name ncu -type f -path '*nsight*' 2>/dev/null | head -n 1)
CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null)
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,launch__registers_per_thread,launch__block_size,launch__grid_size,launch__occupancy_limit_registers
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
metrics+=,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
metrics+=,smsp__average_warp_latency_per_inst_issued.ratio
metrics+=,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
while [ $# -ge 3 ]; do
  label=$1 cmd=$2 regex=$3
  shift 3
  skip=0
  if [ $# -ge 1 ] && [[ $1 =~ ^[0-9]+$ ]]; then skip=$1; shift; fi
  # shellcheck disable=SC2086
  "$NCU" --clock-control none --kernel-name-base mangled -k "regex:$regex" --launch-skip "$skip" -c 1 \
    --metrics "$metrics" --csv --page raw bash -c "$cmd" > "$OUT/ncu_$label.csv" 2> "$OUT/ncu_$label.err"
  # The SASS: from our benchmark binary (it links the packages' kernels), or from Triton's cache
  # (kernels compiled by the command above).
  if [ -n "$CUOBJDUMP" ]; then
    for f in .devlibs/bin/kcpp_bench_kernels "$HOME"/.triton/cache/*/*.cubin; do
      [ -f "$f" ] || continue
      "$CUOBJDUMP" -sass "$f" 2>/dev/null | awk -v re="$regex" '
        /Function :/ { name = $0; sub(/.*Function : /, "", name); keep = name ~ re }
        keep' >> "$OUT/sass_$label.txt"
    done
  fi
done
python3 - "$OUT" "$metrics" <<'PY'
import csv, glob, os, sys
out, wanted = sys.argv[1], sys.argv[2].split(",")
rows = {}
for path in sorted(glob.glob(os.path.join(out, "ncu_*.csv"))):
    label = os.path.basename(path)[4:-4]
    lines = [l for l in open(path) if l.startswith('"')]
    if len(lines) < 3:
        print(f"{label}: no kernel profiled (see ncu_{label}.err)")
        continue
    r = list(csv.reader(lines))
    head, data = r[0], r[2]
    rows[label] = dict(zip(head, data))
if not rows:
    sys.exit(0)
labels = list(rows)
keys = [k for k in wanted if k in next(iter(rows.values()))]
short = lambda k: k.replace("smsp__average_warps_issue_stalled_", "stall ").replace("_per_issue_active.ratio", "")
print("%-52s" % "metric" + "".join("%16s" % l[:16] for l in labels))
for k in keys:
    print("%-52s" % short(k)[:52] + "".join("%16s" % rows[l].get(k, "")[:16] for l in labels))
for l in labels:
    print(l, ":", rows[l].get("Kernel Name", "")[:150])
for f in sorted(glob.glob(os.path.join(out, "sass_*.txt"))):
    n = sum(1 for line in open(f) if line.strip().startswith("/*") and "*/" in line and ";" in line)
    print(os.path.basename(f), "SASS instructions:", n)
PY
# One file back instead of many (the device tool returns a limited number of files).
(cd "$OUT" && tar -cJf profile.tar.xz ncu_*.csv ncu_*.err sass_*.txt 2>/dev/null && rm -f ncu_*.csv ncu_*.err sass_*.txt)
