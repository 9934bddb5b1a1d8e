#!/usr/bin/env python3
"""The SASS of two builds' kernels side by side, on the development machine (no GPU needed): for every
kernel of OLD and NEW (objects, libraries or executables with sm_90a code, e.g. two builds' package
libraries) its instruction count and an md5 of its instructions (addresses left out, so a kernel that
only moved compares equal), and the counts that decide a Hopper kernel's schedule: HGMMA (warpgroup
MMAs), WARPGROUP.DEPBAR (ptxas waits after a wgmma: one per wgmma means it serialized them, see
docs/DESIGN.md section 10), and STL / LDL (spills).  With one file, its kernels alone.

  scripts/sass_diff.py OLD NEW [--filter REGEX] [--ops]
  e.g. scripts/sass_diff.py old/libflash_attn.so build/sm90/kernels/flash_attn/build/kcpp1-cu130-x86_64-linux/libflash_attn.so --filter bwd

--filter keeps the kernels whose mangled name matches; --ops prints, for kernels that differ, each
instruction mnemonic's count in both.  cuobjdump and nvdisasm come from the CUDA toolkit where it has
them, else from NVIDIA's PyPI wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), fetched once into
build/tools/cuda-bin.
"""
import argparse
import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(HERE, "..", "build", "tools", "cuda-bin")
WHEELS = {"cuobjdump": "nvidia-cuda-cuobjdump==13.2.51", "nvdisasm": "nvidia-cuda-nvdisasm==13.2.86"}


def tool_dir():
    """A folder holding cuobjdump and nvdisasm: the toolkit's, or build/tools/cuda-bin (fetched)."""
    for d in [os.path.dirname(shutil.which("cuobjdump") or ""), "/usr/local/cuda/bin", TOOLS]:
        if d and all(os.access(os.path.join(d, t), os.X_OK) for t in WHEELS):
            return d
    os.makedirs(TOOLS, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for tool, spec in WHEELS.items():
            if os.access(os.path.join(TOOLS, tool), os.X_OK):
                continue
            print(f"sass_diff: fetching {spec} from PyPI into {TOOLS}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", tmp], check=True)
            wheel = next(os.path.join(tmp, w) for w in os.listdir(tmp) if w.startswith(spec.split("==")[0].replace("-", "_")))
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith("/bin/" + tool))
                with z.open(member) as src, open(os.path.join(TOOLS, tool), "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.chmod(os.path.join(TOOLS, tool), 0o755)
    return TOOLS


def kernels(path, tools):
    """{mangled kernel name: [instructions without addresses]} of every sm_90a function in `path`."""
    env = dict(os.environ, PATH=tools + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"sass_diff: cuobjdump failed on {path}: {out.stderr.strip()}")
    found, name = {}, None
    for line in out.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            found[name] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+([^;]*);", line)
        if m and name:
            found[name].append(" ".join(m.group(1).split()))
    return found


def mnemonic(ins):
    """An instruction's opcode with its modifiers, its predicate left out."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", ins).split(" ")[0]


def summary(ins):
    ops = [mnemonic(i) for i in ins]
    count = lambda prefix: sum(o.startswith(prefix) for o in ops)
    return {"n": len(ins), "md5": hashlib.md5("\n".join(ins).encode()).hexdigest()[:8], "hgmma": count("HGMMA"),
            "depbar": count("WARPGROUP.DEPBAR"), "spill": count("STL") + count("LDL")}


def demangled(names):
    """{mangled: its demangled name without namespaces, return type and parameters} (c++filt where it is)."""
    out = {n: n for n in names}
    if shutil.which("c++filt"):
        lines = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
        for n, d in zip(names, lines):
            depth, cut = 0, len(d)
            for i, ch in enumerate(d):  # the parameter list: the first '(' outside template brackets
                depth += ch == "<"
                depth -= ch == ">"
                if ch == "(" and depth == 0 and not d.startswith("(", i + 1) and "anonymous" not in d[i:i + 12]:
                    cut = i
                    break
            d = d[:cut]
            out[n] = re.sub(r"^(void |\w+ )|[\w:]*\(anonymous namespace\)::|\w+::", "", d)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="OLD [NEW]: objects or libraries with sm_90a code")
    ap.add_argument("--filter", default="", help="keep kernels whose mangled name matches this regex")
    ap.add_argument("--ops", action="store_true", help="for kernels that differ, each mnemonic's count in both")
    a = ap.parse_args()
    if len(a.files) > 2:
        ap.error("one or two files")
    tools = tool_dir()
    sides = [kernels(f, tools) for f in a.files]
    names = sorted({n for s in sides for n in s if re.search(a.filter, n)})
    if not names:
        sys.exit("sass_diff: no kernel matches")
    cols = ["n", "md5", "hgmma", "depbar", "spill"]
    header = "  ".join(f"{c:>8}" for c in cols)
    print(f"{'kernel':70}  {header}" + (f"  |  {header}  same" if len(sides) == 2 else ""))
    label = demangled(names)
    for n in names:
        row = []
        for s in sides:
            row.append(summary(s[n]) if n in s else None)
        cells = ["  ".join(f"{str(r[c]):>8}" for c in cols) if r else f"{'(absent)':>{9 * len(cols) - 1}}" for r in row]
        same = "" if len(sides) == 1 else ("  yes" if row[0] and row[1] and row[0]["md5"] == row[1]["md5"] else "  NO")
        print(f"{label[n][:70]:70}  " + "  |  ".join(cells) + same)
        if a.ops and len(sides) == 2 and same == "  NO" and all(row):
            c0 = collections.Counter(mnemonic(i) for i in sides[0][n])
            c1 = collections.Counter(mnemonic(i) for i in sides[1][n])
            for op in sorted(set(c0) | set(c1)):
                if c0[op] != c1[op]:
                    print(f"    {op:40} {c0[op]:6} -> {c1[op]:6}")


if __name__ == "__main__":
    main()
