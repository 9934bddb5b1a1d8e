#!/usr/bin/env bash
# Runs on a lent machine with several GPUs (carry .devlibs): data parallelism in one call — the main
# job on one GPU, then on every GPU with the same global batch (plain, then ZeRO stage 1), so that
# the losses and tokens/s compare.  NCCL is PyTorch's (site-packages/nvidia/nccl/lib), found here.
# KCPP_MGPU_ARGS passes options to every `kcpp train` (default: 200 steps, batch 64, the kernels).
# The multi-GPU runs: ZeRO-0, 1, 2 and 3 with the gradients reduced during the backward (ZeRO-3
# gathering each layer at its use), ZeRO-3 gathering during the use before it (--prefetch) and
# with nothing on a side stream (--no-overlap), then ZeRO-0 reducing after the backward
# (--no-overlap).  KCPP_MGPU_RUNS picks runs, comma-separated (e.g. "2,3,3 --prefetch"; "none": neither
# these nor the one-GPU run).  KCPP_MGPU_TESTS=0 skips the Dist tests.  KCPP_MGPU_CURVES=1 first
# compares the loss curves of the reference layers in f32 over 20 steps, one GPU against every stage
# on all of them.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
echo "== commit ${KCPP_COMMIT:-unknown}, $(date -u +%F)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nccl_dir=$(python3 -c "import os, nvidia.nccl; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null ||
           dirname "$(find / -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -n 1)")
export LD_LIBRARY_PATH="$nccl_dir:$LD_LIBRARY_PATH" KCPP_PACKAGES_DIR="$PWD/.devlibs/kernels"
# The lending workplace requires NVLink multicast (NVLS) off on its multi-GPU machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
n=$(nvidia-smi -L | wc -l)
args=${KCPP_MGPU_ARGS:---steps 200 --batch 64}
echo "== $n GPUs, NCCL from $nccl_dir; kcpp train $args"
if [ "${KCPP_MGPU_TESTS:-1}" != 0 ]; then
  echo "== Dist tests (ranks as threads on the CPU; *OnTheGpuOverNccl: a group of one over NCCL)"
  # Dist.* is every test of tests/test_dist.cpp (collectives, data parallelism, ZeRO checkpoints).
  KCPP_FIXTURES_DIR="$PWD/tests/fixtures" timeout 240 .devlibs/bin/kcpp_tests --gtest_brief=1 --gtest_filter='Dist.*' 2>&1 | tail -n 15
fi
if [ "${KCPP_MGPU_CURVES:-0}" = 1 ]; then
  echo "== f32 loss curves, reference layers, 20 steps, batch 64 (a line every 2 steps)"
  timeout 120 .devlibs/bin/kcpp train --dtype f32 --reference-only --steps 20 --batch 64 2>&1 | grep -oE "step +[0-9]+/20 +loss [0-9.]+" | tr '\n' ';'; echo " <- one GPU"
  for z in 0 1 2 3; do
    timeout 120 .devlibs/bin/kcpp train --dtype f32 --reference-only --steps 20 --batch 64 --gpus "$n" --zero "$z" 2>&1 | grep -oE "step +[0-9]+/20 +loss [0-9.]+" | tr '\n' ';'; echo " <- $n GPUs ZeRO-$z"
  done
fi
if [ "${KCPP_MGPU_RUNS:-}" != none ]; then
  echo "-- one GPU"
  timeout 200 .devlibs/bin/kcpp train $args 2>&1 | grep -E "reference|kernels|error" | tail -n 3
  IFS=, read -ra runs <<< "${KCPP_MGPU_RUNS:-0,1,2,3,3 --prefetch,3 --no-overlap,0 --no-overlap}"
else
  runs=()
fi
for run in "${runs[@]}"; do
  set -- $run
  echo "-- $n GPUs, ZeRO-$1 ${2:-}"
  timeout 200 .devlibs/bin/kcpp train $args --gpus "$n" --zero "$@" 2>&1 | grep -E "reference|kernels|error|failed" | tail -n 4
done
# KCPP_MGPU_WEAK="--hidden 4096 --layers 4 --seq 2048 --steps 20": weak scaling, KCPP_MGPU_WEAK_BATCH
# sequences a GPU (default 4) on 1, 2, 4, ... up to every GPU, ZeRO-1 (tokens/s per GPU compare; add
# "--vocab 128256" for Llama-3's vocabulary).  KCPP_MGPU_WEAK_RUNS runs each multi-GPU size once per
# comma-separated set of extra options (e.g. "--embedding-grad sparse,--embedding-grad dense,
# --overlap-param-gather"; default: one run with none).
if [ -n "${KCPP_MGPU_WEAK:-}" ]; then
  per=${KCPP_MGPU_WEAK_BATCH:-4}
  echo "== weak scaling: kcpp train --kernels-only $KCPP_MGPU_WEAK, $per sequences a GPU, ZeRO-1"
  IFS=, read -ra variants <<< "${KCPP_MGPU_WEAK_RUNS:- }"
  g=1
  while [ "$g" -le "$n" ]; do
    if [ "$g" -gt 1 ]; then todo=("${variants[@]}"); else todo=(" "); fi
    for extra in "${todo[@]}"; do
      echo "-- $g GPU(s), batch $((per * g)) $extra"
      timeout 300 .devlibs/bin/kcpp train --kernels-only $KCPP_MGPU_WEAK --batch $((per * g)) --gpus "$g" \
        --zero $([ "$g" -gt 1 ] && echo 1 || echo 0) $extra 2>&1 |
        grep -E "kernels|error|failed|memory" | tail -n 3
    done
    g=$((g * 2))
  done
fi
# compare_with SCRIPT "KCPP TRAIN OPTIONS ON SEVERAL GPUS" PREFIX KERNELS...: on one GPU, then on every
# GPU, kcpp train beside SCRIPT's run with each --kernels choice (its result lines start with PREFIX).
compare_with() {
  local script="$1" several="$2" prefix="$3"
  shift 3
  local dims=${KCPP_MGPU_FSDP2_ARGS:---hidden 4096 --layers 4 --vocab 128256}
  echo "== $n GPUs: kcpp train against Transformers in $script ($dims, seq 2048, 4 sequences a GPU)"
  for g in 1 "$n"; do
    timeout 200 .devlibs/bin/kcpp train --kernels-only $dims --seq 2048 --steps 20 --batch $((4 * g)) --gpus "$g" \
      $([ "$g" -gt 1 ] && echo "$several") 2>&1 | grep -E "done:|error|failed" | cut -c1-220
    for k in "$@"; do
      timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node "$g" "$script" $dims --seq 2048 \
        --batch 4 --steps 15 --kernels "$k" --reduce-dtype bf16 2>&1 | grep -E "^$prefix|Error" | head -n 8
    done
  done
}
# KCPP_MGPU_FSDP2=1: issue 27's comparison at Llama-3's vocabulary, on every GPU with 4 x 2048 tokens
# a GPU: `kcpp train --gpus N --zero 1 --overlap-param-gather` beside Transformers under PyTorch FSDP2
# with Liger's kernels (its default fused loss, then its plain cross-entropy, the faster at these
# dimensions) and with kcpp's (bench/fsdp2_step.py: the same dimensions; Liger's source in
# .anchors/src, carried), and each on one GPU.  KCPP_MGPU_FSDP2_ARGS adds options to both (default
# "--hidden 4096 --layers 4 --vocab 128256").
if [ "${KCPP_MGPU_FSDP2:-0}" = 1 ]; then
  export LIGER_SRC="$PWD/.anchors/src" PYTHONPATH="$PWD/.devlibs/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  compare_with bench/fsdp2_step.py "--zero 1 --overlap-param-gather" FSDP2 liger liger_ce kcpp
fi
# KCPP_MGPU_DEEPSPEED=1: the same comparison under DeepSpeed ZeRO-3 (bench/deepspeed_step.py): `kcpp train
# --zero 3` beside Transformers + kcpp's kernels and + Liger's (its fused loss, then its plain
# cross-entropy) under deepspeed.initialize, on one GPU and on every GPU.  DeepSpeed is not in the GPU
# machine's image: its wheel and those of its dependencies are carried in .devwheels/ds (git-ignored;
# `pip download` them for Python 3.12 and build DeepSpeed's with DS_BUILD_OPS=0) and installed here.
if [ "${KCPP_MGPU_DEEPSPEED:-0}" = 1 ]; then
  ds_site=$(mktemp -d)
  python3 -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$ds_site" .devwheels/ds/*.whl
  export LIGER_SRC="$PWD/.anchors/src" PYTHONPATH="$PWD/.devlibs/python:$ds_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  compare_with bench/deepspeed_step.py "--zero 3" ZeRO-3 kcpp liger liger_ce
fi
# KCPP_MGPU_MAMBA=1: the Mamba fixture fine-tuned in f32 on one GPU and on every GPU at ZeRO 0, 1, 2 and
# 3, and 1 with the all-gather deferred (--overlap-param-gather), with the same global batch
# (DataParallel(MambaLM&)): the loss at every step, which should agree.
if [ "${KCPP_MGPU_MAMBA:-0}" = 1 ]; then
  text="$OUT/mamba_upper.txt"
  for _ in 1 2 3 4 5 6 7 8; do printf 'THE MILLER COUNTS 12 SACKS OF GRAIN BY THE RIVER. '; done > "$text"
  m="--model $PWD/tests/fixtures/mamba --tokenizer $PWD/tests/fixtures/tokenizers/bytes97.json --data $text --dtype f32 --steps 10 --batch 8 --seq 16"
  echo "== Mamba fixture, f32, 10 steps of 8 x 16 tokens: one GPU, then $n GPUs at ZeRO 0 / 1 / 2 / 3 / 1 deferred gather"
  timeout 120 .devlibs/bin/kcpp train $m 2>&1 | grep -oE "step +[0-9]+/10 +loss [0-9.]+|error.*" | tr '\n' ';'; echo " <- one GPU"
  for z in 0 1 2 3 "1 --overlap-param-gather"; do
    timeout 120 .devlibs/bin/kcpp train $m --gpus "$n" --zero $z 2>&1 | grep -oE "step +[0-9]+/10 +loss [0-9.]+|error.*" | tr '\n' ';'
    echo " <- $n GPUs ZeRO-$z"
  done
fi
