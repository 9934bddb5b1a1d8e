"""kernels.cpp for Python: kernel packages from the hub, verified by the C++ hub, called through the
package C ABI (include/kcpp/abi.h) with tensors crossing by DLPack — PyTorch, NumPy, or anything
with `__dlpack__`, and no build against any of them.

    import kcpp, torch
    hub = kcpp.Hub(allow_all_kernels=True)             # HF_ENDPOINT, HF_HUB_OFFLINE, ... from the environment
    liger = hub.load(kcpp.local_packages()["liger"])   # or "kernels-community/liger@^0.1"
    rms = liger.layer("LigerRMSNorm")
    y, rstd = torch.empty_like(x), torch.empty(x.shape[0])
    rms.forward({"x": x, "weight": w, "eps": 1e-6, "y": y, "rstd": rstd}, mode="training")

`Hub` is kcpp::hub::Hub: references (`org/repo@>=1.0,<2:Layer`, `/abs/folder:Layer`), versions,
variants, sha256 of every file, Ed25519 signatures and the trust store, lock files and the Hugging
Face cache are all checked in C++; nothing is verified here.  `kcpp.torch` kernelizes Hugging Face
Transformers models with these layers.

Where the extension kcpp._core is not built (a source tree used without `pip install .`), only
`Package(path)` over a library file is available, through `kcpp._ctypes` (the same calls, more host
time per call, no hub).
"""
import os
from pathlib import Path

from ._errors import HubDisabled, InvalidArgument, KcppError, Unsupported

try:
    from . import _core
except ImportError as _e:  # a source tree without the extension: the ctypes bridge alone
    if os.environ.get("KCPP_REQUIRE_CORE"):
        raise
    _core = None
    _core_error = _e

MODE_INFERENCE, MODE_TRAINING, MODE_GRAPH = 1, 2, 4

if _core is not None:
    Hub, Layer, Op, KernelConfig = _core.Hub, _core.Layer, _core.Op, _core.KernelConfig
    _PackageType = _core.Package

    def Package(path):
        """A package library file opened as it is, without the hub's verification (tests,
        benchmarks; `Hub.load` is the verified way).  ImportError when it is not a kcpp package."""
        try:
            return _core.open_library(str(path))
        except KcppError as e:
            raise ImportError(str(e)) from None
else:
    from ._ctypes import Layer, Op, Package  # noqa: F401

    def Hub(*args, **kwargs):
        raise ImportError("kcpp.Hub needs the extension kcpp._core: install the package (pip install . from the "
                          f"repository) or build it (scripts/python-env.sh, then scripts/build.sh) ({_core_error})")

    KernelConfig = Hub


def local_packages():
    """{name: folder} of the kernel packages built with this kcpp (liger, activation, flash_attn, ...):
    those installed beside the package by `pip install .`, else those of the build tree the extension
    was built in; KCPP_PACKAGES_DIR overrides.  Each folder is a package (manifest.json + build/), a
    local reference for `Hub.load` (unsigned: load it with allow_all_kernels)."""
    candidates = [os.environ.get("KCPP_PACKAGES_DIR", ""), str(Path(__file__).parent / "packages")]
    if _core is not None:
        candidates.append(_core.BUILD_PACKAGES_DIR)
    for root in candidates:
        if root and Path(root).is_dir():
            found = {p.name: str(p.resolve()) for p in sorted(Path(root).iterdir()) if (p / "manifest.json").is_file()}
            if found:
                return found
    return {}


def load(reference, **hub_options):
    """`Hub(**hub_options).load(reference)`: a loaded, verified package."""
    return Hub(**hub_options).load(reference)


# ---- use_kernels with no config: the default mapping ----------------------------------------------------

DEFAULT_KERNEL_ORG = "kernels-cpp"


def default_kernel_mapping():
    """The mapping a model gets when kernels are asked for with no mapping, the C++ runtime's
    (nn::default_kernel_mapping; `kcpp generate` / `kcpp train` without --kernels): this project's
    packages on the hub, `kernels-cpp/liger@^0.1:LigerRMSNorm`, ... (docs/DESIGN.md, section 5)."""
    import json
    if _core is None:
        raise ImportError("kcpp.default_kernel_mapping needs the extension kcpp._core")
    return json.loads(_core.default_kernel_mapping_json())


def default_kernel_config():
    """default_kernel_mapping() as a kcpp.KernelConfig."""
    return KernelConfig(_core.default_kernel_mapping_json())


def default_loader(**hub_options):
    """The loader for default_kernel_mapping()'s references (nn::default_loader): `.load(reference)` loads
    this project's package from the hub, or, when the hub cannot supply it (offline, unreachable, not
    published, not trusted here), this build's package from local_packages(), verified against its
    manifest; the package's `substituted` then says so.  Errors of integrity (a hash, a signature, a lock)
    are raised as they are.  `hub_options` as Hub's; without them one attempt per request (an
    unreachable hub costs no retries)."""
    if _core is None:
        raise ImportError("kcpp.default_loader needs the extension kcpp._core")
    return _core.DefaultLoader(local_packages(), **hub_options)


# ---- the extension's hooks for CUDA calls (PyTorch's allocator) ---------------------------------------

def _workspace(nbytes, device_type, device_id):
    """A CUDA workspace block from PyTorch's caching allocator (stream-ordered on the current stream)."""
    import torch
    if device_type != 2:
        raise RuntimeError(f"no workspace allocator for DLPack device type {device_type}")
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device_id))


def _workspace_done(blocks, stream):
    """The kernel ran on `stream`, not PyTorch's current one: the blocks may be reused only after it."""
    import torch
    if not blocks:
        return
    device = blocks[0].device
    if stream == torch.cuda.current_stream(device).cuda_stream:
        return
    other = torch.cuda.ExternalStream(stream, device=device)
    for block in blocks:
        block.record_stream(other)
