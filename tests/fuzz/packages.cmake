# fuzz_package_calls (fuzz_package_calls.cpp): every kernel package's CPU variant linked into one fuzz
# target, each package's sources compiled as kcpp_add_package compiles them (its name, version,
# definitions and libraries) but with its entry symbol renamed kcpp_package_v1_<name>, so that the
# packages can share one executable.  Included from packages/CMakeLists.txt once every package is added.
get_property(_fuzz_packages GLOBAL PROPERTY KCPP_PACKAGES)
add_executable(fuzz_package_calls ${CMAKE_CURRENT_LIST_DIR}/fuzz_package_calls.cpp)
target_include_directories(fuzz_package_calls PRIVATE ${PROJECT_SOURCE_DIR}/include)
target_link_libraries(fuzz_package_calls PRIVATE dlpack::dlpack)
foreach(p IN LISTS _fuzz_packages)
  get_property(srcs GLOBAL PROPERTY KCPP_PACKAGE_${p}_SOURCES)
  get_property(dir GLOBAL PROPERTY KCPP_PACKAGE_${p}_DIR)
  get_property(ver GLOBAL PROPERTY KCPP_PACKAGE_${p}_VERSION)
  get_property(libs GLOBAL PROPERTY KCPP_PACKAGE_${p}_LIBRARIES)
  get_property(defs GLOBAL PROPERTY KCPP_PACKAGE_${p}_DEFINITIONS)
  add_library(fuzz_pkg_${p} OBJECT ${srcs})
  target_include_directories(fuzz_pkg_${p} PRIVATE ${PROJECT_SOURCE_DIR}/include ${dir})
  target_compile_definitions(fuzz_pkg_${p} PRIVATE KCPP_PACKAGE_NAME="${p}" KCPP_PACKAGE_VERSION="${ver}" KCPP_WITH_CUDA=0
                                                    kcpp_package_v1=kcpp_package_v1_${p} ${defs})
  target_compile_options(fuzz_pkg_${p} PRIVATE -fno-trapping-math -Wno-pass-failed)
  target_link_libraries(fuzz_pkg_${p} PRIVATE dlpack::dlpack ${libs})
  target_link_libraries(fuzz_package_calls PRIVATE fuzz_pkg_${p} ${libs})
endforeach()
target_compile_options(fuzz_package_calls PRIVATE -Wall -Wextra)
target_link_options(fuzz_package_calls PRIVATE -fsanitize=fuzzer)
set_target_properties(fuzz_package_calls PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
add_dependencies(kcpp_fuzz fuzz_package_calls)
