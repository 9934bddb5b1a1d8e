"""Reads the records of tools/kernel_trace (libkcpp_kernel_trace.so): one line a kernel, tab-separated
start and end (ns, the GPU's clock), stream, graph id and name.  Used by the device-*-timeline.sh
scripts on the GPU machine."""
import shutil
import subprocess


def short(name, width=100):
    """A kernel's name without its parameter list, namespaces and anonymous-namespace tags (names
    CUPTI gives mangled are demangled first, by demangle())."""
    n = name.replace("(anonymous namespace)::", "")
    if n.endswith(")"):
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                n = n[:i]
                break
    for prefix in ("void ", "kcpp::ops::cuda::", "kcpp::kernel::cuda::", "kcpp::"):
        n = n.replace(prefix, "")
    return n[:width]


def demangle(names):
    """The names demangled by c++filt where the machine has it (else as given)."""
    tool = shutil.which("c++filt")
    if not tool or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else list(names)


def read(path, width=100):
    """[(start, end, stream, graph, short name)] in the file's order."""
    raw = [line.rstrip("\n").split("\t", 4) for line in open(path)]
    names = demangle([r[4] for r in raw])
    return [(int(r[0]), int(r[1]), int(r[2]), int(r[3]), short(n, width)) for r, n in zip(raw, names)]
