# The install tests (tests/CMakeLists.txt), as a CMake script:
#   STEP=install   `cmake --install` this build into WORK_DIR/staged, then move it to WORK_DIR/prefix
#                  (the installed tree must not depend on where it was put)
#   STEP=consumer  configure, build and run tests/consumer against WORK_DIR/prefix
# -D arguments: STEP, BUILD_DIR, WORK_DIR; for consumer also SOURCE_DIR, GENERATOR, MAKE_PROGRAM,
# LAUNCHER (ccache, or empty), and this build's CXX_COMPILER, BUILD_TYPE and CXX_FLAGS (a sanitizer
# build's libraries need the sanitizer's runtime linked in).
cmake_minimum_required(VERSION 3.25)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE "${WORK_DIR}")
  run("cmake --install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/staged")
  file(GLOB_RECURSE config "${WORK_DIR}/staged/kcppConfig.cmake")
  if(NOT config)
    message(FATAL_ERROR "cmake --install ${BUILD_DIR} put no kcppConfig.cmake under ${WORK_DIR}/staged")
  endif()
  file(RENAME "${WORK_DIR}/staged" "${WORK_DIR}/prefix")
  message("installed into ${WORK_DIR}/prefix")
elseif(STEP STREQUAL "consumer")
  set(build "${WORK_DIR}/consumer-build")
  file(REMOVE_RECURSE "${build}")
  set(args -S "${SOURCE_DIR}" -B "${build}" -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
           "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}" "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
  if(MAKE_PROGRAM)
    list(APPEND args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  if(LAUNCHER)
    list(APPEND args "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
  endif()
  run("configuring tests/consumer" ${CMAKE_COMMAND} ${args})
  run("building tests/consumer" ${CMAKE_COMMAND} --build "${build}")
  run("running tests/consumer" "${build}/kcpp_consumer")
  message("${out}")
else()
  message(FATAL_ERROR "run_test.cmake: STEP must be install or consumer, not '${STEP}'")
endif()
