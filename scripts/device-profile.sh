#!/usr/bin/env bash
# On the lent GPU: Nsight Compute on our RMSNorm forward and, for comparison, Liger's (from
# .anchors/).  --clock-control none: the card's clocks are left as they are (METHOD.md).
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
NCU=$(command -v ncu || find / -name ncu -type f -path '*nsight*' 2>/dev/null | head -n 1)
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats"
"$NCU" --clock-control none $sections -k regex:'forward_(loop|registers)' -c 2 .devlibs/bin/kcpp_bench_kernels > "$OUT/ncu_kcpp.txt" 2>&1
"$NCU" --clock-control none $sections -k regex:'rms_norm' -c 2 python3 .anchors/liger_rms_fwd.py > "$OUT/ncu_liger.txt" 2>&1
for f in "$OUT"/ncu_kcpp.txt "$OUT"/ncu_liger.txt; do
  echo "== $f"
  grep -E "^  [a-zA-Z_].*\(|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Registers Per Thread|Block Size|Grid Size|Theoretical Occupancy|Stall|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Issued Warp" "$f" | head -n 60
done
