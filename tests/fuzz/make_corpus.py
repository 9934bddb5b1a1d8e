#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target into tests/fuzz/corpus/<target>/: small valid inputs
and edge cases, several taken from tests/fixtures.  Run it again after changing it; libFuzzer
mutates from these (scripts/fuzz.sh), and inputs that once broke a parser are kept beside them
as regression-* files, which this script leaves alone."""
import base64
import hashlib
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
for fam in ["mamba", "falcon_mamba", "mixtral", "qwen3_moe", "qwen2_moe", "mistral_swa", "qwen3_swa"]:
    write("config", f"seed-{fam}", (FIXTURES / fam / "config.json").read_bytes())
mamba = json.loads((FIXTURES / "mamba" / "config.json").read_text())
write("config", "seed-mamba-auto-rank", dumps(dict(mamba, time_step_rank="auto", intermediate_size=None, bos_token_id=[0, 1],
                                                   eos_token_id=[0], pad_token_id=None, torch_dtype="bfloat16")))


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


# ---- Hub API answers: refs and tree, as kcpp serve writes them and as huggingface.co does
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def ref(name, tag):
    return {"name": name, "ref": ("refs/tags/" if tag else "refs/heads/") + name, "targetCommit": COMMIT}


write("hub_api", "seed-refs-serve", json.dumps({"branches": [ref("main", False)], "tags": [ref("v1.0.0", True), ref("1.2.0-rc.1", True)],
                                                "converts": []}))
write("hub_api", "seed-refs-hf", dumps({"branches": [ref("main", False), ref("feature/x", False)], "converts": [],
                                        "tags": [ref("v0.1.0", True)], "pullRequests": [{"name": "refs/pr/1", "ref": "refs/pr/1",
                                                                                          "targetCommit": COMMIT}]}))
write("hub_api", "seed-tree-serve", json.dumps([{"type": "file", "path": p, "size": n, "oid": SHA[:40], "lfs": {"oid": SHA, "size": n}}
                                                for p, n in [("manifest.json", 812), (f"build/{cpu}/libexample.so", 4096)]]))
write("hub_api", "seed-tree-hf", dumps([{"type": "directory", "oid": SHA[:40], "size": 0, "path": "build"},
                                        {"type": "file", "oid": SHA[:40], "size": 812, "path": "manifest.json"},
                                        {"type": "file", "oid": SHA[:40], "size": 4096, "path": f"build/{cpu}/libexample.so",
                                         "lfs": {"oid": SHA, "size": 4096, "pointerSize": 134}}]))
write("hub_api", "edge-empty-refs", "{}")
write("hub_api", "edge-empty-tree", "[]")


# ---- trust: byte 0 picks the input's kind (fuzz_trust.cpp); keys and signatures of RFC 8032's test vectors
P25519 = 2**255 - 19
L25519 = 2**252 + 27742317777372353535851937790883648493
D25519 = -121665 * pow(121666, P25519 - 2, P25519) % P25519


def _ed_x(y, sign):
    x2 = (y * y - 1) * pow(D25519 * y * y + 1, P25519 - 2, P25519) % P25519
    x = pow(x2, (P25519 + 3) // 8, P25519)
    if (x * x - x2) % P25519:
        x = x * pow(2, (P25519 - 1) // 4, P25519) % P25519
    return P25519 - x if x & 1 != sign else x


def _ed_add(p, q):  # extended coordinates (X, Y, Z, T)
    a, b = (p[1] - p[0]) * (q[1] - q[0]) % P25519, (p[1] + p[0]) * (q[1] + q[0]) % P25519
    c, d = 2 * D25519 * p[3] * q[3] % P25519, 2 * p[2] * q[2] % P25519
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % P25519, g * h % P25519, f * g % P25519, e * h % P25519)


def _ed_mul(k, p):
    out = (0, 1, 1, 0)
    while k:
        if k & 1:
            out = _ed_add(out, p)
        p, k = _ed_add(p, p), k >> 1
    return out


def _ed_encode(p):
    zi = pow(p[2], P25519 - 2, P25519)
    x, y = p[0] * zi % P25519, p[1] * zi % P25519
    return (y | (x & 1) << 255).to_bytes(32, "little")


_BY = 4 * pow(5, P25519 - 2, P25519) % P25519
_B = (_ed_x(_BY, 0), _BY, 1, _ed_x(_BY, 0) * _BY % P25519)


def ed25519_sign(seed, message):
    """(public key, signature) of `message` under the 32-byte secret `seed` (RFC 8032, 5.1.6)."""
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little") & ~7 & ((1 << 254) - 1) | (1 << 254)
    public = _ed_encode(_ed_mul(a, _B))
    r = int.from_bytes(hashlib.sha512(h[32:] + message).digest(), "little") % L25519
    big_r = _ed_encode(_ed_mul(r, _B))
    k = int.from_bytes(hashlib.sha512(big_r + public + message).digest(), "little") % L25519
    return public, big_r + ((r + k * a) % L25519).to_bytes(32, "little")


def b64(b):
    return base64.b64encode(b).decode()


SEED1 = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")  # RFC 8032 7.1 TEST 1
SEED2 = bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb")  # TEST 2
PUB1, SIG1 = ed25519_sign(SEED1, b"")
PUB2, SIG2 = ed25519_sign(SEED2, b"r")
assert PUB1.hex() == "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
assert SIG1.hex().startswith("e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155")
assert SIG2.hex().startswith("92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da")
KEY1, KEY2 = "ed25519:" + b64(PUB1), "ed25519:" + b64(PUB2)


def trust(kind, name, text):
    write("trust", name, bytes([kind]) + (text.encode() if isinstance(text, str) else text))


trust(0, "seed-store", dumps({"publishers": {"acme": [KEY1]}}))
trust(0, "seed-store-two", dumps({"publishers": {"acme": [KEY2, KEY1], "kernels-community": [b64(PUB2)]}}))
trust(0, "edge-store-empty", '{"publishers": {}}')
trust(1, "seed-pub", dumps({"kcpp_key": 1, "publisher": "acme", "algorithm": "ed25519", "public_key": KEY1}))
trust(1, "seed-key", dumps({"kcpp_key": 1, "publisher": "acme", "algorithm": "ed25519", "public_key": KEY1,
                            "secret_key": b64(SEED1 + PUB1)}))
trust(1, "edge-key-other-public", dumps({"kcpp_key": 1, "publisher": "acme", "algorithm": "ed25519", "public_key": KEY2,
                                         "secret_key": b64(SEED1 + PUB1)}))
for i, text in enumerate([KEY1, b64(PUB2), "AA==", "Zm9vYmFy", "Zm9vYg==", "", "rsa:AAAA", "ed25519:" + b64(PUB1[:31])]):
    trust(2, f"seed-text-{i}", text)
trust(3, "seed-signature-empty", f"{KEY1}\n{b64(SIG1)}\n")
trust(3, "seed-signature-r", f"{KEY2}\n{b64(SIG2)}\nr")
manifest_plain = {"kcpp_manifest": 1, "name": "example", "version": "1.0.0", "abi_version": 1,
                  "variants": {cpu: {"library": f"build/{cpu}/libexample.so",
                                     "files": {f"build/{cpu}/libexample.so": {"sha256": SHA, "size": 4096}}}}}
_, msig = ed25519_sign(SEED1, json.dumps(manifest_plain, separators=(",", ":"), sort_keys=True).encode())
signed = dict(manifest_plain, signature={"algorithm": "ed25519", "publisher": "acme", "public_key": KEY1, "value": b64(msig)})
trust(4, "seed-manifest-signed", dumps(signed))
trust(4, "seed-manifest-tampered", dumps(dict(signed, version="1.0.1")))
trust(4, "seed-manifest-other-publisher", dumps(dict(signed, signature=dict(signed["signature"], publisher="other"))))
trust(4, "seed-manifest-unsigned", dumps(manifest_plain))
trust(5, "seed-list", f"acme={KEY1};kernels-community={b64(PUB2)}, other = {KEY2} ;")
trust(5, "edge-list-no-key", "acme")


# ---- training checkpoints: trainer_state.json, then each rank's optimizer state, each ending at KCPPFILE
def f32s(values):
    return struct.pack(f"<{len(values)}f", *values)


def optimizer_file(pieces, meta):
    """pieces: {param: (elements, has master)} -> a safetensors file of its exp_avg, exp_avg_sq (and master)."""
    header, data = {"__metadata__": meta}, b""
    for param, (n, master) in pieces.items():
        for key in ["exp_avg", "exp_avg_sq"] + (["master"] if master else []):
            header[f"{param}.{key}"] = {"dtype": "F32", "shape": [n], "data_offsets": [len(data), len(data) + 4 * n]}
            data += f32s([0.25 * (i + 1) for i in range(n)])
    return safetensors(header, data)


state = dumps({"steps_done": 2, "seed": 1, "batch": 16, "seq": 64, "lr": 0.003, "dtype": "f32", "data": "data.jsonl",
               "data_tokens": 40960, "data_sha256": SHA, "lr_scheduler": "cosine", "warmup_steps": 1, "schedule_steps": 10})
AdamW = {"format": "kcpp AdamW state"}
whole = optimizer_file({"w": (6, False), "b": (4, True)}, dict(AdamW, steps="2"))
write("checkpoint", "seed-state", state)
write("checkpoint", "seed-state-before-data", dumps({"steps_done": 2, "seed": 1, "batch": 16, "seq": 64, "lr": 0.003, "dtype": "f32"}))
write("checkpoint", "seed-one-rank", state.encode() + b"KCPPFILE" + whole)
write("checkpoint", "seed-two-ranks",
      state.encode() + b"KCPPFILE" +
      optimizer_file({"w": (3, False), "b": (2, True)}, dict(AdamW, steps="2", slices='{"b":[0,4],"w":[0,6]}')) + b"KCPPFILE" +
      optimizer_file({"w": (3, False), "b": (2, True)}, dict(AdamW, steps="2", slices='{"b":[2,4],"w":[3,6]}')))
write("checkpoint", "seed-stage0-copies", state.encode() + b"KCPPFILE" + whole + b"KCPPFILE" + whole)
write("checkpoint", "edge-missing-master", state.encode() + b"KCPPFILE" +
      optimizer_file({"w": (6, False), "b": (4, False)}, dict(AdamW, steps="2")))

# ---- model.safetensors.index.json over the shards fuzz_weight_index.cpp writes
shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
write("weight_index", "seed-two-shards", dumps({"metadata": {"total_size": 68}, "weight_map": {
    "lm_head.weight": shard2, "model.embed_tokens.weight": shard1, "model.norm.weight": shard1}}))
write("weight_index", "seed-single", dumps({"weight_map": {"model.norm.weight": "model.safetensors"}}))
write("weight_index", "edge-wrong-shard", dumps({"weight_map": {"lm_head.weight": shard1}}))
write("weight_index", "edge-outside", dumps({"weight_map": {"lm_head.weight": "../" + shard2}}))
write("weight_index", "edge-empty", '{"weight_map": {}}')

# ---- tokenizer_config.json: the chat template and the special tokens
features = (FIXTURES / "chat_templates" / "features.jinja").read_text()
small = pieces[0]
write("tokenizer_config", "seed-string", dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": None, "pad_token": None,
                                                "chat_template": small, "model_max_length": 4096}))
write("tokenizer_config", "seed-added-tokens", dumps({
    "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False,
                  "rstrip": False, "single_word": False}, "eos_token": "<|eot_id|>", "chat_template": features}))
write("tokenizer_config", "seed-list", dumps({"eos_token": "<|im_end|>", "chat_template": [
    {"name": "default", "template": small}, {"name": "tool_use", "template": pieces[2]}]}))
write("tokenizer_config", "edge-no-template", dumps({"bos_token": "<s>"}))
write("tokenizer_config", "edge-list-without-default", dumps({"chat_template": [{"name": "rag", "template": small}]}))

# ---- kcpp train --data files: byte 0 holds the flags of fuzz_training_data.cpp (1: .jsonl, 2: the text
# field "content" named, 4: assistant-only loss, 8: Qwen2's tokenizer)
def training(flags, name, text):
    write("training_data", name, bytes([flags]) + text.encode())


conversation = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, café"},
                             {"role": "assistant", "content": "Hello."}]}
lines = [{"text": "The gentle gardener sings to a clever clock."}, {"prompt": "2 + 2 =", "completion": " 4"}, conversation]
training(0, "seed-plain", "The café opens at nine.\nIt closes at five.\n")
training(1, "seed-jsonl-text", "\n".join(json.dumps(j, ensure_ascii=False) for j in lines[:1] * 2) + "\n")
training(1, "seed-jsonl-prompt", json.dumps(lines[1]) + "\n\n" + json.dumps({"prompt": "", "completion": "x"}) + "\n")
training(1, "seed-jsonl-messages", json.dumps(conversation, ensure_ascii=False) + "\n")
training(5, "seed-jsonl-assistant-only", json.dumps(conversation, ensure_ascii=False) + "\n")
training(13, "seed-jsonl-assistant-only-qwen2", json.dumps(conversation, ensure_ascii=False) + "\n")
training(3, "seed-jsonl-field", json.dumps({"content": "named field", "text": "not this"}) + "\n")
training(9, "seed-jsonl-mixed-qwen2", "\n".join(json.dumps(j, ensure_ascii=False) for j in lines) + "\r\n")
training(1, "edge-jsonl-not-object", "[1, 2]\n")
training(1, "edge-jsonl-no-text", json.dumps({"text": ""}) + "\n")

# ---- kcpp serve's routing: a request line "METHOD TARGET HTTP/1.1" (and headers, which the router
# does not read) over fuzz_serve_routing.cpp's served folder; "{commit}" is acme/example@v1.0.0's commit
def request(name, target, method="GET", headers=""):
    write("serve_routing", name, f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n")


for i, target in enumerate([
        "/api/models/acme/example/refs", "/api/models/acme/example/revision/v1.0.0", "/api/models/acme/example/revision/main",
        "/api/models/acme/example/tree/v1.0.0?recursive=true", "/api/models/acme/example/tree/v1.0.0/build/",
        "/api/models/acme/example/tree/{commit}", "/acme/example/resolve/v1.0.0/manifest.json",
        "/acme/example/resolve/{commit}/build/kcpp1-cpu-x86_64-linux/libexample.so",
        "/acme/example/resolve/v1.0.0/build/kcpp1-cpu-x86_64-linux/name%20with%20space.txt",
        "/acme/example/resolve/main/README.md", "/acme/other/resolve/1.0.0/x.txt", "/api/models/acme/other/refs"]):
    request(f"seed-{i:02}", target)
request("seed-head", "/acme/example/resolve/v1.0.0/manifest.json", "HEAD")
request("seed-token", "/api/models/acme/example/refs", headers="Authorization: Bearer hf_x\r\n")
# What must never answer 200 (or leave the served folder): traversal, encoded or not, absolute paths,
# NULs, symbolic links out of the folder (a file, a folder, a revision, a repo, an org).
for i, target in enumerate([
        "/acme/example/resolve/v1.0.0/../../../kcpp-outside/kcpp-outside-secret.txt",
        "/acme/example/resolve/v1.0.0/%2e%2e/%2e%2e/%2e%2e/kcpp-outside/kcpp-outside-secret.txt",
        "/acme/example/resolve/v1.0.0/%2E%2E%2F%2E%2E%2Fmain/README.md", "/acme/example/resolve/..%2fmain/README.md",
        "/acme/example/resolve/v1.0.0//etc/passwd", "/acme/example/resolve/v1.0.0/%2fetc%2fpasswd",
        "/acme/example/resolve/v1.0.0/manifest.json%00.txt", "/acme/example/resolve/v1.0.0%00x/manifest.json",
        "/acme/example/resolve/v1.0.0/build/link-out.txt",
        "/acme/example/resolve/v1.0.0/build/dir-out/kcpp-outside-secret.txt", "/api/models/acme/example/tree/v1.0.0/build/dir-out",
        "/acme/example/resolve/linked-rev/kcpp-outside-file.txt", "/api/models/acme/example/tree/linked-rev",
        "/acme/example/resolve/.hidden/manifest.json",
        "/api/models/acme/example/tree/v1.0.0/../main", "/api/models/acme/example/tree/v1.0.0/%2e",
        "/api/models/acme/example/tree/v1.0.0/build/bad%ff%fe.bin", "/acme/example/resolve/v1.0.0/a%2e%2e",
        "/api/models/acme/%2e%2e/refs", "/api/models/acme/example%2f..%2fother/refs",
        "/acme/example/resolve/v1.0.0/build%5c..%5cmanifest.json", "/api/models/acme/example/revision/%u002e%u002e",
        "*", "", "/", "//acme/example/resolve/v1.0.0/manifest.json"]):
    request(f"edge-{i:02}", target)
# (Requests that once got a wrong answer are kept as regression-* files: a revision with a NUL byte,
# symbolic links at the org or repo, a revision that is not UTF-8.)
for method in ["POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT", "get"]:
    request(f"edge-method-{method}", "/api/models/acme/example/refs", method)

# ---- package_calls: one call of each layer and op of the packages, in fuzz_package_calls.cpp's encoding
# (the names and strings are that file's kNames / kStrings, in order; the entries are the packages'
# tables in the order it lists them).
CALL_NAMES = ['x', 'y', 'dy', 'dx', 'weight', 'dweight', 'bias', 'dbias', 'eps', 'offset', 'casting', 'rstd', 'mean', 'residual', 'residual_out', 'dresidual_out', 'gate', 'up', 'out', 'dout', 'dgate', 'dup', 'activation', 'q', 'k', 'v', 'q_out', 'k_out', 'dq_out', 'dk_out', 'dq', 'dk', 'dv', 'cos', 'sin', 'layout', 'style', 'logits', 'targets', 'loss', 'grad', 'lse', 'bad_targets', 'ignore_index', 'label_smoothing', 'reduction', 'lse_square_scale', 'softcap', 'token_weight', 'class_weight', 'dlogits', 'dloss', 'hidden', 'dhidden', 'grad_scale', 'accumulate', 'accum_dtype', 'chunk_rows', 'scale', 'causal', 'window', 'cu_seqlens_q', 'cu_seqlens_k', 'max_seqlen_q', 'max_seqlen_k', 'routing', 'apply_router_weight', 'normalize', 'top_k', 'router_weight', 'router_logits', 'drouter_weight', 'drouter_logits', 'gate_up_proj', 'gate_proj', 'up_proj', 'down_proj', 'dgate_up_proj', 'dgate_proj', 'dup_proj', 'ddown_proj', 'shared_gate_up_proj', 'shared_gate_proj', 'shared_up_proj', 'shared_down_proj', 'shared_expert_gate', 'dshared_gate_up_proj', 'dshared_gate_proj', 'dshared_up_proj', 'dshared_down_proj', 'dshared_expert_gate', 'topk_ids', 'topk_weights', 'dtopk_weights', 'expert_offsets', 'sorted_slots', 'overwrite_gate_up', 'gate_up', 'attention_mask', 'u', 'delta', 'A', 'B', 'C', 'D', 'z', 'delta_bias', 'delta_softplus', 'bc_rms_eps', 'states', 'last_state', 'du', 'ddelta', 'dA', 'dB', 'dC', 'dD', 'dz', 'ddelta_bias', 'state', 'dt', 'dt_bias', 'dt_softplus', 'conv_state', 'value', 'value_spatial_shapes', 'value_level_start_index', 'sampling_locations', 'attention_weights', 'im2col_step', 'dvalue', 'dsampling_locations', 'dattention_weights', 'alpha']
CALL_STRINGS = ['llama', 'gemma', 'none', 'silu', 'swish', 'gelu', 'gelu_tanh', 'quick_gelu', 'bhsd', 'bshd', 'rotate_half', 'interleaved', 'mean', 'sum', 'same', 'f32', 'softmax', 'sigmoid', 'given', 'output', 'input', '', 'relu']
CALL_DTYPES = {"f32": 0, "bf16": 1, "f16": 2, "i32": 3, "i64": 4, "f64": 5, "u8": 6, "i8": 7}
CALL_ENTRIES = ["SiLU", "scale", "LigerRMSNorm", "LigerAddRMSNorm", "LigerLayerNorm", "LigerGLU", "LigerRotaryEmbedding",
                "LigerCrossEntropy", "LigerFusedLinearCrossEntropy", "SiLU/1", "GeLU/1", "GeluTanh/1", "FastGELU/1",
                "NewGELU/1", "QuickGELU/1", "SiluAndMul/1", "GeluAndMul/1", "GeluTanhAndMul/1", "FlashAttention",
                "MegaBlocksMoeMLP", "Llama4TextMoe", "load_balancing_loss", "SelectiveScan", "SelectiveStateUpdate",
                "CausalConv1d", "CausalConv1dUpdate", "MultiScaleDeformableAttention"]


def call(entry, how, *args):
    """entry: CALL_ENTRIES' name; how: 0 supports, 1 forward, 2 backward (+4 training); args: encoded."""
    return bytes([CALL_ENTRIES.index(entry), how]) + b"".join(args)


def t(name, dtype, shape, seed=7):
    return bytes([CALL_NAMES.index(name), 4, CALL_DTYPES[dtype], len(shape)] + list(shape) + [0, seed])


def i(name, v):
    return bytes([CALL_NAMES.index(name), 1]) + struct.pack("<q", v)


def f(name, v):
    return bytes([CALL_NAMES.index(name), 2]) + struct.pack("<d", v)


def s(name, v):
    return bytes([CALL_NAMES.index(name), 3, CALL_STRINGS.index(v)])


TRAIN = 4
calls = {
    "example-silu": call("SiLU", 1, t("x", "f32", [2, 3]), t("y", "f32", [2, 3])),
    "example-silu-bwd": call("SiLU", 2, t("dy", "f32", [2, 3]), t("x", "f32", [2, 3]), t("dx", "f32", [2, 3])),
    "example-scale": call("scale", 1, t("x", "f32", [5]), t("y", "f32", [5]), f("alpha", -2.0)),
    "rms-norm": call("LigerRMSNorm", 1 + TRAIN, t("x", "bf16", [3, 8]), t("weight", "bf16", [8]), t("y", "bf16", [3, 8]),
                     t("rstd", "f32", [3]), f("eps", 1e-6), s("casting", "gemma"), f("offset", 1.0)),
    "rms-norm-bwd": call("LigerRMSNorm", 2 + TRAIN, t("dy", "bf16", [3, 8]), t("x", "bf16", [3, 8]), t("weight", "bf16", [8]),
                         t("rstd", "f32", [3]), t("dx", "bf16", [3, 8]), t("dweight", "bf16", [8])),
    "add-rms-norm": call("LigerAddRMSNorm", 1, t("x", "f32", [3, 8]), t("residual", "f32", [3, 8]), t("weight", "f32", [8]),
                         t("y", "f32", [3, 8]), t("residual_out", "f32", [3, 8])),
    "layer-norm": call("LigerLayerNorm", 1 + TRAIN, t("x", "f32", [3, 8]), t("weight", "f32", [8]), t("bias", "f32", [8]),
                       t("y", "f32", [3, 8]), t("mean", "f32", [3]), t("rstd", "f32", [3])),
    "glu": call("LigerGLU", 1, t("gate", "bf16", [4, 6]), t("up", "bf16", [4, 6]), t("out", "bf16", [4, 6]),
                s("activation", "gelu_tanh")),
    "glu-bwd": call("LigerGLU", 2, t("dout", "f32", [4, 6]), t("gate", "f32", [4, 6]), t("up", "f32", [4, 6]),
                    t("dgate", "f32", [4, 6]), t("dup", "f32", [4, 6])),
    "rope": call("LigerRotaryEmbedding", 1, t("q", "f32", [1, 2, 3, 8]), t("k", "f32", [1, 1, 3, 8]), t("cos", "f32", [3, 8]),
                 t("sin", "f32", [3, 8]), t("q_out", "f32", [1, 2, 3, 8]), t("k_out", "f32", [1, 1, 3, 8])),
    "cross-entropy": call("LigerCrossEntropy", 1 + TRAIN, t("logits", "f32", [4, 9]), t("targets", "i64", [4], 3),
                          t("loss", "f32", []), t("grad", "f32", [4, 9]), f("label_smoothing", 0.1)),
    "flce": call("LigerFusedLinearCrossEntropy", 1 + TRAIN, t("hidden", "f32", [4, 8]), t("weight", "f32", [9, 8]),
                 t("targets", "i64", [4], 3), t("loss", "f32", []), t("dhidden", "f32", [4, 8]), t("dweight", "f32", [9, 8]),
                 i("chunk_rows", 3)),
    "attention": call("FlashAttention", 1 + TRAIN, t("q", "f32", [1, 2, 5, 8]), t("k", "f32", [1, 1, 5, 8]),
                      t("v", "f32", [1, 1, 5, 8]), t("out", "f32", [1, 2, 5, 8]), t("lse", "f32", [1, 2, 5]), i("causal", 1),
                      f("scale", 0.35), i("window", 3), f("softcap", 5.0)),
    "attention-bwd": call("FlashAttention", 2 + TRAIN, t("dout", "f32", [1, 2, 5, 8]), t("q", "f32", [1, 2, 5, 8]),
                          t("k", "f32", [1, 1, 5, 8]), t("v", "f32", [1, 1, 5, 8]), t("out", "f32", [1, 2, 5, 8]),
                          t("lse", "f32", [1, 2, 5]), t("dq", "f32", [1, 2, 5, 8]), t("dk", "f32", [1, 1, 5, 8]),
                          t("dv", "f32", [1, 1, 5, 8]), i("causal", 1)),
    "moe": call("MegaBlocksMoeMLP", 1, t("hidden", "f32", [4, 8]), t("router_weight", "f32", [4, 8]),
                t("gate_up_proj", "f32", [4, 6, 8]), t("down_proj", "f32", [4, 8, 3]), t("out", "f32", [4, 8]), i("top_k", 2)),
    "load-balancing": call("load_balancing_loss", 1, t("router_logits", "f32", [6, 4]), t("loss", "f32", []), i("top_k", 2),
                           t("drouter_logits", "f32", [6, 4])),
    "scan": call("SelectiveScan", 1, t("u", "f32", [1, 4, 6]), t("delta", "f32", [1, 4, 6]), t("A", "f32", [4, 3]),
                 t("B", "f32", [1, 3, 6]), t("C", "f32", [1, 3, 6]), t("D", "f32", [4]), t("z", "f32", [1, 4, 6]),
                 t("out", "f32", [1, 4, 6]), i("delta_softplus", 1)),
    "state-update": call("SelectiveStateUpdate", 1, t("state", "f32", [1, 4, 3]), t("x", "f32", [1, 4]), t("dt", "f32", [1, 4]),
                         t("A", "f32", [4, 3]), t("B", "f32", [1, 3]), t("C", "f32", [1, 3]), t("out", "f32", [1, 4])),
    "conv1d": call("CausalConv1d", 1, t("x", "f32", [1, 4, 6]), t("weight", "f32", [4, 3]), t("bias", "f32", [4]),
                   t("out", "f32", [1, 4, 6]), s("activation", "silu")),
    "conv1d-update": call("CausalConv1dUpdate", 1, t("x", "f32", [1, 4]), t("conv_state", "f32", [1, 4, 3]),
                          t("weight", "f32", [4, 3]), t("out", "f32", [1, 4])),
    "msda": call("MultiScaleDeformableAttention", 1, t("value", "f32", [1, 6, 2, 4]), t("value_spatial_shapes", "i64", [1, 2], 2),
                 t("value_level_start_index", "i64", [1], 2), t("sampling_locations", "f32", [1, 3, 2, 1, 2, 2]),
                 t("attention_weights", "f32", [1, 3, 2, 1, 2]), t("out", "f32", [1, 3, 8]), i("im2col_step", 64)),
}
for k, name in enumerate(["SiLU/1", "GeLU/1", "GeluTanh/1", "FastGELU/1", "NewGELU/1", "QuickGELU/1"]):
    calls[f"act-{k}"] = call(name, 1, t("x", "bf16", [2, 8]), t("y", "bf16", [2, 8]))
for k, name in enumerate(["SiluAndMul/1", "GeluAndMul/1", "GeluTanhAndMul/1"]):
    calls[f"glu-act-{k}"] = call(name, 1, t("x", "f16", [2, 8]), t("y", "f16", [2, 4]))
for name, data in calls.items():
    write("package_calls", f"seed-{name}", data)
