# System dependencies (Debian packages; scripts/install-deps.sh installs them).
# Each find names the Debian package that provides it, so a failed configure says what to install.

find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)                       # gcc's libgomp

# OpenBLAS built for OpenMP (libopenblas-openmp-dev), so that its GEMMs run on the same libgomp team
# as every parallel loop of the library and its packages (src/ops/threads.h: one pool of threads).
# Debian installs it beside the pthread build under one soname, libopenblas.so.0, and the system's
# default is the pthread one: the binaries find the OpenMP build first through their run path, which
# CMake fills with the directory of the library linked here (the installed tool's too: its install run
# path is its link path, tools/kcpp/CMakeLists.txt; a consumer of find_package(kcpp) links the same file).
# (Found by path, not through OpenBLASConfig.cmake, whose cached OpenBLAS_DIR would keep a build
# folder configured before on the pthread build.)
find_library(KCPP_OPENBLAS_OPENMP openblas NO_DEFAULT_PATH
             PATHS /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp)
find_path(KCPP_OPENBLAS_OPENMP_INCLUDE cblas.h NO_DEFAULT_PATH
          PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp)
if(NOT KCPP_OPENBLAS_OPENMP OR NOT KCPP_OPENBLAS_OPENMP_INCLUDE)
  message(FATAL_ERROR "OpenBLAS's OpenMP build not found: install libopenblas-openmp-dev (scripts/install-deps.sh)")
endif()
add_library(kcpp_blas INTERFACE)
target_include_directories(kcpp_blas SYSTEM INTERFACE ${KCPP_OPENBLAS_OPENMP_INCLUDE})
target_link_libraries(kcpp_blas INTERFACE ${KCPP_OPENBLAS_OPENMP})

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
