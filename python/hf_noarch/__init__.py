"""A kernels.cpp package as the Hugging Face `kernels` library loads it: this noarch variant
(build/torch-<backend>/, written by cmake/KcppPackage.cmake from python/hf_noarch/) holds no kernel;
its layers call the package's library, which the C++ hub verifies and loads (kcpp.hf_kernels).
It needs the Python package kernels-cpp (import kcpp) in the same environment."""
from . import layers  # noqa: F401
