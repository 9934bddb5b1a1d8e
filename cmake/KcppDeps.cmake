# System dependencies (Debian packages; scripts/install-deps.sh installs them).
# Each find names the Debian package that provides it, so a failed configure says what to install.

find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)                       # gcc's libgomp

# OpenBLAS (libopenblas-dev): Debian ships a CMake config with include dir and library.
find_package(OpenBLAS CONFIG QUIET)
if(OpenBLAS_FOUND)
  add_library(kcpp_blas INTERFACE)
  target_include_directories(kcpp_blas SYSTEM INTERFACE ${OpenBLAS_INCLUDE_DIRS})
  target_link_libraries(kcpp_blas INTERFACE ${OpenBLAS_LIBRARIES})
else()
  message(FATAL_ERROR "OpenBLAS not found: install libopenblas-dev (scripts/install-deps.sh)")
endif()

# fmt (libfmt-dev), header-only so that binaries carry no libfmt.so dependency to the GPU machine.
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)                               # nlohmann-json3-dev
find_package(CLI11 REQUIRED)                                       # libcli11-dev
find_package(dlpack REQUIRED)                                      # libdlpack-dev
if(KCPP_BUILD_TESTS)
  find_package(GTest REQUIRED)                                     # libgtest-dev
endif()
if(KCPP_BUILD_BENCH)
  find_package(benchmark REQUIRED)                                 # libbenchmark-dev
endif()

# The hub (src/hub, tools/kcpp): package signatures and hashes (libsodium-dev), the HTTP client
# (libcurl4-openssl-dev), `kcpp serve` (libcpp-httplib-dev, a compiled library whose flags come from
# its pkg-config file), dlopen.
find_package(PkgConfig REQUIRED)
pkg_check_modules(SODIUM REQUIRED IMPORTED_TARGET libsodium)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)  # the tokenizers' pre-tokenization regexes
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)  # the tokenizers' Unicode normalizers
find_package(CURL REQUIRED)
