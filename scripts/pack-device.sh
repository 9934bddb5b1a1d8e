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
# KCPP_PACK_BINS names the binaries one call needs (default: all of build/<preset>/bin) — the whole
# set with the Python package is near the 64 MiB limit of a carried tree.
if [ -n "${KCPP_PACK_BINS:-}" ]; then
  for b in $KCPP_PACK_BINS; do cp build/"$preset"/bin/"$b" "$stage/bin/"; done
else
  cp build/"$preset"/bin/* "$stage/bin/"
fi
# libsodium and cpp-httplib (the hub) and utf8proc (the tokenizer) are not in the device image (Ubuntu 24.04); libcurl, OpenSSL,
# zlib and brotli are.
for lib in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libgomp.so.1 libsodium.so.23 libcpp-httplib.so.0.11 libutf8proc.so.2; do
  path=$(for b in "$stage"/bin/*; do ldd "$b"; done | awk -v l="$lib" '$1 == l { print $3 }' | head -n 1 || true)
  [ -n "$path" ] || continue  # none of the packed binaries uses it
  cp -L "$path" "$stage/lib/"
done
# The built kernel packages and the hub tests' fixture libraries (a build of only some targets may
# lack the fixtures: built here, they take seconds).
cp -r build/"$preset"/kernels "$stage/kernels"
mkdir -p "$stage/fixtures"
if ! compgen -G "build/$preset/tests/hub/*.so" >/dev/null; then
  fixtures=$(cmake --build build/"$preset" --target help | awk -F: '/^kcpp_fixture_[^.]*:/ { print $1 }')
  [ -n "$fixtures" ] || { echo "pack-device: build/$preset has no hub fixture targets (configure it with the tests)" >&2; exit 1; }
  # shellcheck disable=SC2086  # one target a word
  cmake --build build/"$preset" --target $fixtures >/dev/null
fi
cp build/"$preset"/tests/hub/*.so "$stage/fixtures/"
# With KCPP_DEVICE_PYTHON (a Python of the GPU machine's minor version with nanobind, e.g. a venv of
# pyenv's 3.12): the package kcpp with its extension built for that Python against this build's
# installed library (python/CMakeLists.txt as a project of its own), as .devlibs/python/kcpp.
extra=()
if [ -n "${KCPP_DEVICE_PYTHON:-}" ]; then
  cmake --install build/"$preset" --prefix build/"$preset"-install >/dev/null
  cmake -S python -B build/"$preset"-device-python -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/$preset-install" \
    -DKCPP_PYTHON_EXECUTABLE="$KCPP_DEVICE_PYTHON" >/dev/null
  cmake --build build/"$preset"-device-python
  mkdir -p "$stage/python"
  cp -r build/"$preset"-device-python/kcpp "$stage/python/kcpp"
  extra+=(python)
fi
rm -rf .devlibs && mkdir -p .devlibs
tar -C "$stage" -cf - bin lib kernels fixtures "${extra[@]}" | xz -T2 -6 > .devlibs/pack.tar.xz
du -sh .devlibs
