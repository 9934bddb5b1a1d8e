# `cmake --install <build> --prefix P`: what other projects use (README, "Use from CMake").
#
#   P/include/kcpp/            include/kcpp/ (abi.h, kernel/) and src/'s headers (core/, ops/, hub/, ...)
#   P/lib/libkcpp_*.a          one static library per layer (src/CMakeLists.txt)
#   P/bin/kcpp                 the tool (tools/kcpp/CMakeLists.txt)
#   P/lib/kcpp/kernels/<pkg>/  the built kernel packages in the hub layout (cmake/KcppPackage.cmake)
#   P/lib/cmake/kcpp/          kcppConfig.cmake, kcppConfigVersion.cmake, kcppTargets.cmake
#
# The rules themselves sit beside the targets; this file writes the package configuration.  Every
# path into the installed tree is relative to the configuration file, so an installed tree may be
# moved (the system libraries it links stay where the build found them).
include(CMakePackageConfigHelpers)

set(KCPP_INSTALL_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/kcpp" CACHE STRING
    "Where `cmake --install` puts kcppConfig.cmake (relative to the prefix)")
set(_kcpp_cuda_root "")
if(KCPP_HAVE_CUDA)
  cmake_path(GET CUDAToolkit_BIN_DIR PARENT_PATH _kcpp_cuda_root)
endif()

install(EXPORT kcppTargets NAMESPACE kcpp:: DESTINATION "${KCPP_INSTALL_CMAKE_DIR}")
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/kcppConfig.cmake.in" "${PROJECT_BINARY_DIR}/cmake/kcppConfig.cmake"
                              INSTALL_DESTINATION "${KCPP_INSTALL_CMAKE_DIR}"
                              PATH_VARS KCPP_INSTALL_PACKAGE_DIR)
# 0.x: a minor version may break the API, so 0.1 answers requests for 0.1.* only.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/cmake/kcppConfigVersion.cmake"
                                 COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/cmake/kcppConfig.cmake" "${PROJECT_BINARY_DIR}/cmake/kcppConfigVersion.cmake"
        DESTINATION "${KCPP_INSTALL_CMAKE_DIR}")
