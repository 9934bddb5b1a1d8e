#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target into tests/fuzz/corpus/<target>/: small valid inputs
and edge cases, several taken from tests/fixtures.  Run it again after changing it; libFuzzer
mutates from these (scripts/fuzz.sh), and inputs that once broke a parser are kept beside them
as regression-* files, which this script leaves alone."""
import json
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
CORPUS = HERE / "corpus"
SHA = "0123456789abcdef" * 4


def write(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def dumps(j):
    return json.dumps(j, indent=1, ensure_ascii=False)


# ---- references and constraints: first line a reference / constraint / version, second a version
for i, text in enumerate([
        "kernels-community/liger@^0.1:LigerRMSNorm", "acme/example", "acme/example@v1.2.0", "acme/example@main:SiLU",
        "acme/example@>=1.0,<2.0", "acme/example@>=1.0 <2.0 || ^3.1.4-rc.1", "/opt/kernels/liger:LigerRMSNorm", "/opt/kernels/x",
        "a.b/c_d-e@feature/x", "1.2.3\n1.2.3-rc.1", "v1.2.3-alpha.1+build.5\n1.2.3-alpha.beta", "~=1.4\n1.9.0", "~1.4\n1.4.7",
        "^0.0.3\n0.0.3", "*\n0.0.0", "1.x\n1.99.0", "<=1.4\n1.4.99", ">1.4\n1.5.0", "!=1.2.3\n1.2.4", ">= 2.0, < 3\n2.5.0",
        "18446744073709551614.0.0\n0.0.1", "0123456789abcdef0123456789abcdef01234567"]):
    write("reference", f"seed-{i:02}", text)

# ---- manifest.json
cpu, cuda = "kcpp1-cpu-x86_64-linux", "kcpp1-cu130-x86_64-linux"


def variant(name, archs=None):
    lib = f"build/{name}/libexample.so"
    v = {"library": lib, "files": {lib: {"sha256": SHA, "size": 4096}, f"build/{name}/variant.json": {"sha256": SHA, "size": 20}},
         "layers": [{"name": "SiLU", "contract": "SiLU/1", "modes": ["inference", "training"], "devices": ["cpu"],
                     "backward": True, "doc": "x * sigmoid(x)"}],
         "ops": [{"name": "scale", "devices": ["cpu", "cuda"], "doc": "y = a * x"}]}
    if archs is not None:
        v["cuda_archs"] = archs
    return v


base = {"kcpp_manifest": 1, "name": "example", "version": "1.0.0", "description": "the smallest package", "abi_version": 1,
        "variants": {cpu: variant(cpu)}}
write("manifest", "seed-cpu", dumps(base))
write("manifest", "seed-cuda", dumps(dict(base, version="1.2.0-rc.1",
                                          variants={cpu: variant(cpu), cuda: variant(cuda, ["80", "90a", "100f", "sm_75", "compute_80", "86-virtual"])})))
write("manifest", "seed-signed", dumps(dict(base, signature={"algorithm": "ed25519", "publisher": "acme",
                                                             "public_key": "ed25519:" + "A" * 43 + "=", "value": "B" * 86 + "=="})))
write("manifest", "seed-other-variants", dumps(dict(base, variants={"kcpp1-rocm70-x86_64-linux": variant("kcpp1-rocm70-x86_64-linux"),
                                                                    "kcpp1-metal-aarch64-darwin": variant("kcpp1-metal-aarch64-darwin"),
                                                                    "kcpp1-xpu20253-x86_64-linux": variant("kcpp1-xpu20253-x86_64-linux")})))
write("manifest", "edge-no-variants", dumps(dict(base, variants={})))

# ---- kcpp.lock
entry = {"repo": "acme/example", "requested": ">=1.0,<2.0", "revision": "v1.2.0", "commit": "c0ffee" * 6 + "beef",
         "manifest_sha256": SHA, "publisher": "acme", "files": {f"build/{cpu}/libexample.so": SHA}}
write("lockfile", "seed-one", dumps({"kcpp_lock": 1, "packages": [entry]}))
write("lockfile", "seed-two", dumps({"kcpp_lock": 1, "packages": [entry, dict(entry, repo="kernels-community/liger", requested="main",
                                                                                     publisher="", files={})]}))
write("lockfile", "edge-empty", '{"kcpp_lock": 1, "packages": []}')
write("lockfile", "edge-no-packages", '{"kcpp_lock": 1}')


# ---- safetensors: 8-byte little-endian header length, JSON header, data
def safetensors(header, data=b"", pad=True):
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


write("safetensors", "seed-f32-bf16", safetensors({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                                                   "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
                                                   "__metadata__": {"format": "pt"}}, bytes(range(32))))
sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1, "I16": 2, "U16": 2, "I8": 1,
         "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
header, at = {}, 0
for dt, es in sizes.items():
    header[dt.lower()] = {"dtype": dt, "shape": [2], "data_offsets": [at, at + 2 * es]}
    at += 2 * es
write("safetensors", "seed-every-dtype", safetensors(header, bytes(at)))
write("safetensors", "seed-empty-tensors", safetensors({"e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [0, 0]},
                                                        "s": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}}, bytes(8)))
write("safetensors", "seed-unaligned", safetensors({"u": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}}, bytes(5), pad=False))
write("safetensors", "edge-empty-header", safetensors({}))
write("safetensors", "edge-truncated", safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)))
write("safetensors", "edge-short", b"\x10\x00\x00")

# ---- config.json: the fixtures' six families, then the rope variants
for fam in ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"]:
    write("config", f"seed-{fam}", (FIXTURES / fam / "config.json").read_bytes())
llama = json.loads((FIXTURES / "llama" / "config.json").read_text())
for name, rope in [("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}),
                   ("dynamic", {"type": "dynamic", "factor": 2.0}), ("linear", {"rope_type": "linear", "factor": 4.0})]:
    write("config", f"seed-rope-{name}", dumps(dict(llama, rope_scaling=rope)))
write("config", "seed-rope-parameters", dumps(dict(llama, rope_parameters={"rope_theta": 500000.0, "rope_type": "default",
                                                                          "partial_rotary_factor": 0.5})))
write("config", "seed-ids-window", dumps(dict(llama, eos_token_id=[1, 2], pad_token_id=0, sliding_window=16, head_dim=8)))


# ---- tokenizer.json: small byte-level BPE files covering each supported piece
def byte_alphabet():
    out, n = [], 256
    for b in range(256):
        printable = 33 <= b <= 126 or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
        out.append(chr(b if printable else n))
        n += not printable
    return out


alpha = byte_alphabet()
vocab = {s: i for i, s in enumerate(alpha[32:127])}  # space and ASCII printables
merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a"]
for m in merges:
    vocab.setdefault(m.replace(" ", ""), len(vocab))
byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
split = {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"},
         "behavior": "Isolated", "invert": False}
added = [{"id": len(vocab), "content": "<|bos|>", "special": True}, {"id": len(vocab) + 1, "content": "<|eos|>", "special": True},
         {"id": len(vocab) + 2, "content": "<tool>", "special": False}]
template = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                                     {"SpecialToken": {"id": "<|eos|>", "type_id": 0}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [added[0]["id"]]}, "<|eos|>": {"id": "<|eos|>", "ids": [added[1]["id"]]}}}


def tokenizer(**kw):
    t = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
         "decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "unk_token": None, "byte_fallback": False,
                                                      "ignore_merges": False, "vocab": vocab, "merges": merges}}
    model = dict(t["model"], **kw.pop("model", {}))
    t.update(kw)
    t["model"] = model
    return dumps(t)


write("tokenizer_load", "seed-gpt2-like", tokenizer(post_processor=byte_level))
write("tokenizer_load", "seed-llama3-like", tokenizer(pre_tokenizer={"type": "Sequence", "pretokenizers": [split, dict(byte_level, use_regex=False)]},
                                                      post_processor={"type": "Sequence", "processors": [byte_level, template]},
                                                      model={"ignore_merges": True, "merges": [m.split(" ") for m in merges]}))
write("tokenizer_load", "seed-qwen2-like", tokenizer(normalizer={"type": "NFC"},
                                                     pre_tokenizer={"type": "Sequence", "pretokenizers": [
                                                         {"type": "Digits", "individual_digits": True},
                                                         {"type": "Split", "pattern": {"String": "."}, "behavior": "Isolated"},
                                                         dict(byte_level, add_prefix_space=True)]},
                                                     decoder={"type": "Sequence", "decoders": [{"type": "ByteLevel"}]},
                                                     model={"unk_token": "?"}))
write("tokenizer_load", "edge-wordpiece", tokenizer(model={"type": "WordPiece"}))

# ---- tokenizer text: byte 0 picks gpt2 / llama3 / qwen2 / kcpp byte-level, byte 1 the flags
texts = [t["text"] for tok in json.loads((FIXTURES / "tokenizers" / "expected.json").read_text()).values()
         if isinstance(tok, list) for t in tok]  # the tokenizers' rows ("normalizers" holds other tables)
for i, text in enumerate(texts[:12]):
    write("tokenizer_text", f"seed-{i:02}", bytes([i % 4, i % 4]) + text.encode())
write("tokenizer_text", "seed-added", b"\x00\x03<|endoftext|>a<|endoftext|>")
write("tokenizer_text", "seed-llama3-special", b"\x01\x01<|begin_of_text|>Hi<|eot_id|>")
write("tokenizer_text", "seed-qwen2-chat", b"\x02\x02<|im_start|>user\n\xe4\xbd\xa0\xe5\xa5\xbd<|im_end|>")
write("tokenizer_text", "edge-invalid-utf8", b"\x00\x00\xff\xfe\xc3(\xed\xa0\x80")
write("tokenizer_text", "edge-decomposed", b"\x02\x00cafe\xcc\x81")

# ---- KernelConfig mapping: byte 0 is use_local_kernel
mappings = [
    {"RMSNorm": "kernels-community/liger@^0.1:LigerRMSNorm"},
    {"SiLU": {"cuda": "acme/act:SiLU", "cpu": ""}},
    {"MLP": {"cuda": [{"ref": "acme/mlp-hopper", "capability": ">=9.0"}, {"ref": "acme/mlp"}]}},
    {"ForCausalLMLoss": {"cuda": {"training": "kernels-community/liger:LigerFusedLinearCrossEntropy", "inference": ""}}},
    {"Attention": {"training|graph": "acme/fa@>=2.0,<3", "inference": {"cuda": "acme/fa", "rocm": "acme/fa-rocm"}}},
]
for i, m in enumerate(mappings):
    write("kernel_config", f"seed-{i}", b"\x00" + dumps(m).encode())
write("kernel_config", "seed-local", b"\x01" + dumps({"RMSNorm": "/opt/kernels/liger:LigerRMSNorm", "MLP": {"cpu": "/opt/kernels/liger"}}).encode())
write("kernel_config", "seed-liger-switches", b"\x00" + dumps({"rope": False, "rms_norm": True, "swiglu": True}).encode())

# ---- chat templates: the committed fixtures, then small pieces of the language
for p in sorted((FIXTURES / "chat_templates").glob("*.jinja")):
    write("chat_template", f"seed-{p.stem}", p.read_bytes())
pieces = [
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "{%- set ns = namespace(i=0) -%}{%- for m in messages[::-1] if m.role == 'user' -%}{%- set ns.i = loop.index0 -%}{%- endfor -%}{{ ns.i }}",
    "{{ tools | tojson(indent=4) }}{% for k, v in tools[0].function.items() if k != 'name' %}{{ k }}={{ v | tojson }}{% endfor %}",
    "{% macro m(x, y='d') %}[{{ x }}|{{ y }}]{% endmacro %}{{ m(1) }}{{ m(2, y=3) }}{{ m('a' ~ 'b') }}",
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no system') }}{% endif %}",
    "{{ messages[2].content.split('</think>')[-1].lstrip('\\n') }}{{ 'x' if enable_thinking is defined and not enable_thinking }}",
    "{{ 'a' * 3 }}{{ [1, 2] + [3] }}{{ 7 // 2 }}{{ 2 ** 8 }}{{ 1.5e3 }}{{ -1 % 5 }}{{ (1,) }}{{ {'k': none} }}",
    "  {%- if true +%}\n  x  {#- c -#}\n  {%+ endif -%}  {{- 'y' -}}  ",
    "{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ loop.index }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list | length }}{{ messages | map(attribute='role') | unique | join(',') }}",
    "{% set x %}{{ bos_token }}{% endset %}{% filter upper %}{{ x }}{% endfilter %}{{ x is string }}{{ none is none }}",
    "{{ messages[4].content | join(' ') }}{{ messages[9] is defined }}{{ messages[0].nope.nope }}",
]
for i, text in enumerate(pieces):
    write("chat_template", f"seed-piece-{i:02}", text)
write("chat_template", "edge-unclosed", "{% if x %}{% for y in z %}{{ y")
write("chat_template", "edge-recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
write("chat_template", "edge-doubling", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
