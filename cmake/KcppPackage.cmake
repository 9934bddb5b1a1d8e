# kcpp_add_package(): builds a kernel package into the hub layout.
#
#   kcpp_add_package(NAME example VERSION 1.0.0
#                    DESCRIPTION "one line"
#                    SOURCES a.cpp b.cpp            # built into every variant
#                    CUDA_SOURCES a.cu              # CUDA variant only
#                    LIBRARIES OpenMP::OpenMP_CXX   # linked into every variant
#                    CUDA_LIBRARIES CUDA::cublas)   # linked into the CUDA variant only
#
# produces, under ${KCPP_PACKAGE_OUTPUT_DIR}/<name>/ (default: <build>/kernels/<name>/):
#   build/kcpp1-cpu-<arch>-<os>/lib<name>.so          always
#   build/kcpp1-cu<XY>-<arch>-<os>/lib<name>.so       when CUDA is on and CUDA_SOURCES are given
#   build/<variant>/variant.json                       {"cuda_archs": [...]} (CUDA variants)
#   build/torch-cpu/, build/torch-cuda/                the Hugging Face `kernels` library's noarch
#                                                      variants: __init__.py and layers.py (python/hf_noarch/:
#                                                      the package's layers as torch modules over the
#                                                      bridge, kcpp.hf_kernels) and metadata.json
#   manifest.json                                      `kcpp package index`: sha256 of every file,
#                                                      layers and ops read from the libraries
# ready to be signed (`kcpp package sign`) and published (copied to a hub repo's revision folder).
# `cmake --install` copies that folder, byte for byte (the manifest's hashes still hold), to
# <prefix>/${KCPP_INSTALL_PACKAGE_DIR}/<name>/, where the installed `kcpp` tool looks for this build's
# packages and kcppConfig.cmake points (kcpp_PACKAGES_DIR).
#
# Each library sees only include/ (a package never includes src/), defines KCPP_PACKAGE_NAME and
# KCPP_PACKAGE_VERSION (strings) and KCPP_WITH_CUDA (0/1), exports nothing but kcpp_package_v1
# (hidden visibility), and carries its own libstdc++ (linked statically) so that one binary loads
# into any host.
set(KCPP_PACKAGE_OUTPUT_DIR "${PROJECT_BINARY_DIR}/kernels" CACHE PATH "Where kcpp_add_package writes packages")
include(GNUInstallDirs)
set(KCPP_INSTALL_PACKAGE_DIR "${CMAKE_INSTALL_LIBDIR}/kcpp/kernels" CACHE STRING
    "Where `cmake --install` puts the kernel packages (relative to the prefix)")

string(TOLOWER "${CMAKE_SYSTEM_NAME}" _kcpp_os)
set(_kcpp_arch "${CMAKE_SYSTEM_PROCESSOR}")
if(_kcpp_arch STREQUAL "amd64" OR _kcpp_arch STREQUAL "AMD64")
  set(_kcpp_arch x86_64)
elseif(_kcpp_arch STREQUAL "arm64")
  set(_kcpp_arch aarch64)
endif()

function(_kcpp_package_library target name version out_dir with_cuda)
  add_library(${target} MODULE ${ARGN})
  set_target_properties(${target} PROPERTIES
    OUTPUT_NAME ${name}
    PREFIX lib
    LIBRARY_OUTPUT_DIRECTORY ${out_dir}
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_definitions(${target} PRIVATE KCPP_PACKAGE_NAME="${name}" KCPP_PACKAGE_VERSION="${version}"
                                               KCPP_WITH_CUDA=${with_cuda})
  # -fno-trapping-math: kernels make no promise about floating-point exception flags, which lets GCC
  # if-convert the clamps of kcpp/kernel/activation.h and vectorize them (NaN and inf are unaffected).
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -O3 -fno-trapping-math>
                                           $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-fvisibility=hidden>)
  target_link_libraries(${target} PRIVATE dlpack::dlpack)
  target_link_options(${target} PRIVATE -static-libstdc++ -static-libgcc -Wl,--no-undefined -Wl,--exclude-libs,ALL)
  if(with_cuda)
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
  endif()
endfunction()

# The noarch variants build/<variant>/ of the Hugging Face `kernels` library (variants.py: "torch-<backend>"):
# python/hf_noarch/'s __init__.py and layers.py copied as they are, and metadata.json as kernels'
# Metadata reads it (a kernel name of lower-case letters, digits and '-': '_' becomes '-'; `version`
# the package's major version; no `archs`, so that kernels' own architecture check defers to the
# kcpp hub, which picks the library variant for the machine).
set(_KCPP_HF_NOARCH_DIR "${CMAKE_CURRENT_LIST_DIR}/../python/hf_noarch")
function(_kcpp_package_noarch out name version variants)
  string(REPLACE "_" "-" kname "${name}")
  string(TOLOWER "${kname}" kname)
  string(REGEX MATCH "^[0-9]+" major "${version}")
  string(REGEX REPLACE "[^a-zA-Z0-9]" "_" vid "${version}")
  foreach(v IN LISTS variants)
    string(REGEX REPLACE "^torch-" "" backend "${v}")
    string(REPLACE "-" "_" pyname "${kname}")
    configure_file("${_KCPP_HF_NOARCH_DIR}/__init__.py" "${out}/build/${v}/__init__.py" COPYONLY)
    configure_file("${_KCPP_HF_NOARCH_DIR}/layers.py" "${out}/build/${v}/layers.py" COPYONLY)
    file(CONFIGURE OUTPUT "${out}/build/${v}/metadata.json" CONTENT
"{\"name\": \"${kname}\", \"id\": \"_${pyname}_kcpp_${vid}_${backend}\", \"version\": ${major}, \"license\": \"NOASSERTION\", \"python-depends\": [], \"backend\": {\"type\": \"${backend}\"}}
")
  endforeach()
endfunction()

function(kcpp_add_package)
  cmake_parse_arguments(P "" "NAME;VERSION;DESCRIPTION" "SOURCES;CUDA_SOURCES;LIBRARIES;CUDA_LIBRARIES;DEFINITIONS" ${ARGN})
  if(NOT P_NAME OR NOT P_VERSION OR NOT P_SOURCES)
    message(FATAL_ERROR "kcpp_add_package: NAME, VERSION and SOURCES are required")
  endif()
  set(out "${KCPP_PACKAGE_OUTPUT_DIR}/${P_NAME}")
  set(targets)
  set(cuda_variant "")

  set(cpu_variant "kcpp1-cpu-${_kcpp_arch}-${_kcpp_os}")
  _kcpp_package_library(kcpp_package_${P_NAME}_cpu ${P_NAME} ${P_VERSION} "${out}/build/${cpu_variant}" 0 ${P_SOURCES})
  list(APPEND targets kcpp_package_${P_NAME}_cpu)

  if(KCPP_HAVE_CUDA AND P_CUDA_SOURCES)
    string(REGEX MATCH "^([0-9]+)\\.([0-9])" _v "${CMAKE_CUDA_COMPILER_VERSION}")
    set(cuda_variant "kcpp1-cu${CMAKE_MATCH_1}${CMAKE_MATCH_2}-${_kcpp_arch}-${_kcpp_os}")
    _kcpp_package_library(kcpp_package_${P_NAME}_cuda ${P_NAME} ${P_VERSION} "${out}/build/${cuda_variant}" 1
                          ${P_SOURCES} ${P_CUDA_SOURCES})
    list(APPEND targets kcpp_package_${P_NAME}_cuda)
    target_link_libraries(kcpp_package_${P_NAME}_cuda PRIVATE ${P_CUDA_LIBRARIES})
    set(archs "")
    foreach(a IN LISTS CMAKE_CUDA_ARCHITECTURES)
      list(APPEND archs "\"${a}\"")
    endforeach()
    list(JOIN archs ", " archs)
    file(WRITE "${out}/build/${cuda_variant}/variant.json" "{\"cuda_archs\": [${archs}]}\n")
  endif()
  # The `kernels` library's noarch variants (the same Python for every package; only metadata.json
  # differs): torch-cpu and torch-cuda, whichever backend the user's torch was built for.
  set(noarch_variants torch-cpu torch-cuda)
  _kcpp_package_noarch("${out}" ${P_NAME} ${P_VERSION} "${noarch_variants}")
  # A variant folder left by an earlier configuration (CUDA on, now off) must not be indexed.
  file(GLOB existing LIST_DIRECTORIES true "${out}/build/*")
  foreach(dir IN LISTS existing)
    get_filename_component(v "${dir}" NAME)
    if(NOT v STREQUAL "${cpu_variant}" AND NOT v STREQUAL "${cuda_variant}" AND NOT v IN_LIST noarch_variants)
      file(REMOVE_RECURSE "${dir}")
    endif()
  endforeach()

  foreach(t IN LISTS targets)
    target_link_libraries(${t} PRIVATE ${P_LIBRARIES})
    target_compile_definitions(${t} PRIVATE ${P_DEFINITIONS})
  endforeach()

  set(lib_files)
  foreach(t IN LISTS targets)
    list(APPEND lib_files $<TARGET_FILE:${t}>)
  endforeach()
  set(noarch_files)
  foreach(v IN LISTS noarch_variants)
    list(APPEND noarch_files "${out}/build/${v}/__init__.py" "${out}/build/${v}/layers.py" "${out}/build/${v}/metadata.json")
  endforeach()
  add_custom_command(
    OUTPUT "${out}/manifest.json"
    COMMAND kcpp_cli package index "${out}" --description "${P_DESCRIPTION}"
    DEPENDS ${targets} ${lib_files} kcpp_cli ${noarch_files}
    COMMENT "Indexing kernel package ${P_NAME} ${P_VERSION} (${out})"
    VERBATIM)
  add_custom_target(kcpp_package_${P_NAME} ALL DEPENDS "${out}/manifest.json")
  install(DIRECTORY "${out}/" DESTINATION "${KCPP_INSTALL_PACKAGE_DIR}/${P_NAME}" USE_SOURCE_PERMISSIONS)
  set_property(GLOBAL APPEND PROPERTY KCPP_PACKAGES ${P_NAME})
  # What the packages' fuzz target (tests/fuzz/packages.cmake) compiles of each: the CPU sources, the
  # folder they include from, the version, libraries and definitions.
  set(abs_sources)
  foreach(src IN LISTS P_SOURCES)
    get_filename_component(a "${src}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND abs_sources "${a}")
  endforeach()
  set_property(GLOBAL PROPERTY KCPP_PACKAGE_${P_NAME}_SOURCES "${abs_sources}")
  set_property(GLOBAL PROPERTY KCPP_PACKAGE_${P_NAME}_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  set_property(GLOBAL PROPERTY KCPP_PACKAGE_${P_NAME}_VERSION "${P_VERSION}")
  set_property(GLOBAL PROPERTY KCPP_PACKAGE_${P_NAME}_LIBRARIES "${P_LIBRARIES}")
  set_property(GLOBAL PROPERTY KCPP_PACKAGE_${P_NAME}_DEFINITIONS "${P_DEFINITIONS}")
endfunction()
