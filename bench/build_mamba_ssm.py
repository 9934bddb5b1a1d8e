"""Builds mamba-ssm's CUDA selective scan (`selective_scan_cuda`), the anchor of bench/mamba.py, from a
checkout of state-spaces/mamba, on a machine without a GPU, for the lent GPU's PyTorch.

Only what bench/mamba.py calls is compiled: the bf16 forward and the real-weight bf16 backward, for
sm_90, with the flags of mamba-ssm's setup.py.  The other dtypes' entry points, which the extension's
binding refers to, are compiled as stubs that raise, so the library stays about 6 MB (the carried
tree of a device call is limited to 64 MiB).  The checkout is only read; nothing of it is copied into
this repository.

    python3 -m venv /tmp/ssmenv && /tmp/ssmenv/bin/pip install torch==<the GPU machine's> ninja numpy
    /tmp/ssmenv/bin/python bench/build_mamba_ssm.py /path/to/mamba .anchors/ssm
    # then carry .anchors and run bench/mamba.py with PYTHONPATH=.anchors/ssm

PyPI's torch needs its CUDA libraries to import; where they are not installed alongside it, put
nvidia-cusparselt-cu13, nvidia-nvshmem-cu13 and nvidia-cufile on LD_LIBRARY_PATH (the import is all
the build needs of them).  nvcc comes from CUDA_HOME (default /usr/local/cuda).
"""
import os
import shutil
import subprocess
import sys
import tempfile

from torch.utils.cpp_extension import load

STUBS = r"""
// Anchor build only: the dtype variants bench/mamba.py does not call, as errors.
#include <stdexcept>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>
#include <cuda_runtime.h>
#include "selective_scan.h"
#include "selective_scan_common.h"
template <typename input_t, typename weight_t> void selective_scan_fwd_cuda(SSMParamsBase& params, cudaStream_t stream);
template <typename input_t, typename weight_t> void selective_scan_bwd_cuda(SSMParamsBwd& params, cudaStream_t stream);
#define KCPP_NO_FWD(I, W) \
  template <> void selective_scan_fwd_cuda<I, W>(SSMParamsBase&, cudaStream_t) { throw std::runtime_error("not built"); }
#define KCPP_NO_BWD(I, W) \
  template <> void selective_scan_bwd_cuda<I, W>(SSMParamsBwd&, cudaStream_t) { throw std::runtime_error("not built"); }
KCPP_NO_FWD(float, float) KCPP_NO_FWD(float, complex_t) KCPP_NO_FWD(at::Half, float) KCPP_NO_FWD(at::Half, complex_t)
KCPP_NO_BWD(float, float) KCPP_NO_BWD(float, complex_t) KCPP_NO_BWD(at::Half, float) KCPP_NO_BWD(at::Half, complex_t)
KCPP_NO_BWD(at::BFloat16, complex_t)
"""


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: build_mamba_ssm.py MAMBA_CHECKOUT OUT_DIR")
    src = os.path.join(os.path.abspath(sys.argv[1]), "csrc", "selective_scan")
    out = os.path.abspath(sys.argv[2])
    if not os.path.isfile(os.path.join(src, "selective_scan.cpp")):
        sys.exit(f"{src}: no selective_scan.cpp (a checkout of state-spaces/mamba?)")
    work = tempfile.mkdtemp(prefix="kcpp-ssm-build-")
    stubs = os.path.join(work, "stubs.cu")
    with open(stubs, "w") as f:
        f.write(STUBS)
    sources = [os.path.join(src, n) for n in ("selective_scan.cpp", "selective_scan_fwd_bf16.cu",
                                              "selective_scan_bwd_bf16_real.cu")] + [stubs]
    undef = [f"-U__CUDA_NO_{w}__" for w in ("HALF_OPERATORS", "HALF_CONVERSIONS", "BFLOAT16_OPERATORS",
                                             "BFLOAT16_CONVERSIONS", "BFLOAT162_OPERATORS", "BFLOAT162_CONVERSIONS")]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    load("selective_scan_cuda", sources, build_directory=work, verbose=True, extra_include_paths=[src],
         extra_cflags=["-O3", "-std=c++17"],
         extra_cuda_cflags=["-O3", "-std=c++17", *undef, "--expt-relaxed-constexpr", "--expt-extended-lambda",
                            "--use_fast_math", "-lineinfo", "-gencode", "arch=compute_90,code=sm_90"])
    os.makedirs(out, exist_ok=True)
    lib = os.path.join(out, "selective_scan_cuda.so")
    shutil.copy(os.path.join(work, "selective_scan_cuda.so"), lib)
    if shutil.which("strip"):  # -lineinfo's tables are most of the file
        subprocess.run(["strip", "--strip-debug", lib], check=True)
    shutil.rmtree(work, ignore_errors=True)
    print(lib)


if __name__ == "__main__":
    main()
