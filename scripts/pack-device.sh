#!/usr/bin/env bash
# Packs what the lent GPU machine needs to run this build into .devlibs/ (git-ignored; name it in
# the device tool's `carry`): the binaries of build/<preset>/bin and the Debian shared libraries
# they use that the GPU machine's image lacks.  cuBLAS comes from that machine's CUDA install.
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-release}"
rm -rf .devlibs && mkdir -p .devlibs/lib .devlibs/bin
cp build/"$preset"/bin/* .devlibs/bin/
for lib in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libgomp.so.1; do
  cp -L "$(ldd build/"$preset"/bin/kcpp_tests | awk -v l="$lib" '$1 == l { print $3 }')" .devlibs/lib/
done
du -sh .devlibs
