#!/usr/bin/env bash
# Packs what the lent GPU machine needs to run this build into .devlibs/pack.tar.xz (git-ignored;
# name .devlibs in the device tool's `carry`; scripts/device-env.sh unpacks it there): the binaries
# of build/<preset>/bin and the Debian shared libraries they use that the GPU machine's image lacks.
# cuBLAS comes from that machine's CUDA install.  Compressed: the carried tree is limited to 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-release}"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib" "$stage/bin"
cp build/"$preset"/bin/* "$stage/bin/"
# libsodium and cpp-httplib (the hub) and utf8proc (the tokenizer) are not in the device image (Ubuntu 24.04); libcurl, OpenSSL,
# zlib and brotli are.
for lib in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libgomp.so.1 libsodium.so.23 libcpp-httplib.so.0.11 libutf8proc.so.2; do
  path=$(for b in build/"$preset"/bin/*; do ldd "$b"; done | awk -v l="$lib" '$1 == l { print $3 }' | head -n 1 || true)
  [ -n "$path" ] || { echo "pack-device: no binary uses $lib"; exit 1; }
  cp -L "$path" "$stage/lib/"
done
# The built kernel packages and the hub tests' fixture libraries.
cp -r build/"$preset"/kernels "$stage/kernels"
mkdir -p "$stage/fixtures"
cp build/"$preset"/tests/hub/*.so "$stage/fixtures/"
rm -rf .devlibs && mkdir -p .devlibs
tar -C "$stage" -cf - bin lib kernels fixtures | xz -T2 -6 > .devlibs/pack.tar.xz
du -sh .devlibs
