# Sourced by the scripts that run on the lent GPU machine: the output folder and the library path
# for the binaries and Debian libraries that scripts/pack-device.sh put in .devlibs/ (cuBLAS comes
# from that machine's CUDA install).
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# Unpack what scripts/pack-device.sh packed (once per machine).
if [ -f .devlibs/pack.tar.xz ] && [ ! -x .devlibs/bin/kcpp ]; then
  xz -dc .devlibs/pack.tar.xz | tar -C .devlibs -xf -
fi
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
cublas_dir=$(dirname "$(find / -name 'libcublas.so.13' -not -path '/proc/*' 2>/dev/null | head -n 1)")
export LD_LIBRARY_PATH="$PWD/.devlibs/lib:$cublas_dir:${LD_LIBRARY_PATH:-}"

# random_model_folder KEY: a Hugging Face folder (bf16, random weights, seed 0) of bench/generate.py's
# model KEY (qwen3, llama, ...) at its real dimensions, made in a temporary folder; prints its path.
random_model_folder() {
  python3 - "$1" <<'PY'
import sys, tempfile, torch, transformers
sys.path.insert(0, "bench")
from generate import MODELS
_, cfg, cls, dims = MODELS[sys.argv[1]]
torch.manual_seed(0)
m = getattr(transformers, cls)(getattr(transformers, cfg)(**dims)).to(torch.bfloat16)
d = tempfile.mkdtemp(prefix="kcpp-profile-")
m.save_pretrained(d)
print(d)
PY
}
