#!/usr/bin/env bash
# The project's Python environment, build/pyenv: nanobind and scikit-build-core (the extension
# kcpp._core builds with them: python/CMakeLists.txt picks this environment up), NumPy, PyTorch +
# Transformers 5 for kcpp.torch's tests (CTest python.package), Accelerate and PEFT for their Trainer and LoRA tests,
# DeepSpeed for their ZeRO-3 test, and the
# overlay build/pyenv-hf with the Hugging Face `kernels` library (CTest python.hf_kernels).  Idempotent:
# installs what is missing.
#
# PyPI's torch for Linux x86_64 is a CUDA build with its CUDA libraries (about 3 GB of wheels, 5.6 GB
# installed): the first run takes minutes (pip's cache makes the next ones quick).
# KCPP_PYTHON_TORCH=0 skips torch, transformers and deepspeed (kcpp.torch's tests then say they are skipped).
# Afterwards: scripts/build.sh builds the extension too; `pip install .` makes the package from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
env=build/pyenv
base=${KCPP_PYTHON_BASE:-/usr/bin/python3}

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
need=()
"$base" -c "import ensurepip, venv" 2>/dev/null || need+=(python3-venv)
include=$("$base" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
[ -f "$include/Python.h" ] || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "python-env: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

[ -x "$env/bin/python" ] || "$base" -m venv "$env"
pip=("$env/bin/python" -m pip install --disable-pip-version-check --quiet)
"$env/bin/python" -c "import nanobind, scikit_build_core, numpy" 2>/dev/null ||
  "${pip[@]}" "nanobind>=2.4" "scikit-build-core>=0.10" numpy
if [ "${KCPP_PYTHON_TORCH:-1}" != 0 ] && ! "$env/bin/python" -c "import torch, transformers" 2>/dev/null; then
  echo "python-env: installing torch and transformers into $env (PyPI; minutes the first time)"
  start=$SECONDS
  "${pip[@]}" torch "transformers>=5,<6"
  echo "python-env: torch and transformers installed in $((SECONDS - start)) s"
fi
# Accelerate for python.package's test_trainer.py (Transformers' Trainer needs it) and PEFT for its
# test_peft.py (LoRA over kernelized models), with the torch and the Transformers pinned.
if [ "${KCPP_PYTHON_TORCH:-1}" != 0 ] && ! "$env/bin/python" -c "import accelerate, peft" 2>/dev/null; then
  echo "python-env: installing accelerate and peft into $env"
  constraint=$(mktemp)
  "$env/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch')); print('transformers==' + m.version('transformers'))" >"$constraint"
  "${pip[@]}" -c "$constraint" "accelerate>=1.1,<2" "peft>=0.17,<1"
  rm -f "$constraint"
fi
# DeepSpeed for python.package's test_deepspeed.py (kcpp.torch under ZeRO-3 on the CPU): PyPI has it as a
# source distribution whose setup.py builds no C++/CUDA op unless DS_BUILD_OPS=1 (its ops are JIT-built
# when used; the test uses none).  Built as PEP 517 asks, in an isolated environment without torch, it is
# a pure-Python wheel (seconds; pip caches it).  The environment's torch is pinned by a constraint so that
# resolving DeepSpeed's `torch>=2.0` never replaces it.
if [ "${KCPP_PYTHON_TORCH:-1}" != 0 ] && ! "$env/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  echo "python-env: installing deepspeed into $env"
  constraint=$(mktemp)
  "$env/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >"$constraint"
  DS_BUILD_OPS=0 "${pip[@]}" --use-pep517 -c "$constraint" "deepspeed>=0.19,<0.20"
  rm -f "$constraint"
fi
# The Hugging Face `kernels` library for python.hf_kernels (our packages' noarch variants loaded the way
# Transformers' use_kernels loads kernels): kernels 0.17.2, PyPI's newest, and Transformers 5.22.2, the
# newest that accepts it (5.23 on ask for kernels >= 0.18.2), into an overlay the test puts first on
# the path, so build/pyenv's own Transformers stays as it is.  --no-deps: build/pyenv has what both
# import (huggingface_hub, packaging, pyyaml, ...) except tomlkit; kernels' sigstore, used only by its
# `verify-signature` command, is left out.
hf=build/pyenv-hf
if [ "${KCPP_PYTHON_TORCH:-1}" != 0 ] && ! PYTHONPATH=$hf "$env/bin/python" -c "import kernels, tomlkit" 2>/dev/null; then
  echo "python-env: installing kernels 0.17.2 and transformers 5.22.2 into $hf"
  "$env/bin/python" -m pip install --disable-pip-version-check --quiet --no-deps --target "$hf" \
    "kernels==0.17.2" "transformers==5.22.2" "tomlkit>=0.13.3"
fi
"$env/bin/python" - <<'PY'
import importlib
import importlib.metadata
have = []
for name in ("nanobind", "numpy", "torch", "transformers", "accelerate", "peft"):
    try:
        have.append(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        have.append(f"{name} absent")
try:  # not imported: DeepSpeed picks (and logs) an accelerator when imported
    have.append(f"deepspeed {importlib.metadata.version('deepspeed')}")
except importlib.metadata.PackageNotFoundError:
    have.append("deepspeed absent")
print("python-env: build/pyenv has " + ", ".join(have))
PY
