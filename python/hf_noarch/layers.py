"""The package's layers as torch modules for the Hugging Face `kernels` library and Transformers'
`use_kernels` (`KernelConfig(kernel_mapping={"RMSNorm": "/path/to/liger:LigerRMSNorm"})`): one class
per package layer whose contract has a Transformers counterpart, named as the package names it.
kcpp.hf_kernels builds them over the package's library, loaded through the C++ hub."""
try:
    from kcpp import hf_kernels as _hf
except ImportError as _e:
    raise ImportError("this kernels.cpp package's layers need the Python package kernels-cpp (import kcpp) in this "
                      "environment: `pip install .` in the kernels.cpp repository, or PYTHONPATH=<build>/python of "
                      f"the build that made the package ({_e})") from None

globals().update(_hf.layers_for(__file__))
