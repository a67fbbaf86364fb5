# ctest driver: configure tests/guest (a host project with add_subdirectory(kvlite)) in a scratch directory and
# check what kvlite did to the host: no CMAKE_BUILD_TYPE forced into its cache, no CMAKE_CUDA_ARCHITECTURES in
# its cache, CUDA off by default and on when asked; then build and run the host's app.
# Arguments: -DBUILD_DIR=... -DSOURCE_DIR=... [-DWITH_NVCC=ON]
set(work ${BUILD_DIR}/guest-check)
file(REMOVE_RECURSE ${work})
include(${SOURCE_DIR}/tests/check_run.cmake)
function(expect text pattern what)
  if(NOT text MATCHES "${pattern}")
    message(FATAL_ERROR "${what}: /${pattern}/ not found in:\n${text}")
  endif()
endfunction()
function(cache_value variable out)
  file(STRINGS ${work}/build/CMakeCache.txt lines REGEX "^${variable}:")
  set(${out} "${lines}" PARENT_SCOPE)
endfunction()

# 1. As a guest with nothing asked: CUDA off, the host's cache untouched.
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/guest -B ${work}/build -DKVLITE_SOURCE_DIR=${SOURCE_DIR})
expect("${last_output}" "kvlite: CUDA backend OFF \\(KVLITE_CUDA=OFF\\)" "CUDA must be off in a guest by default")
expect("${last_output}" "kvlite: compiled with -O2 in the host's Debug or unset build type"
       "a guest in a host without a build type must build kvlite optimised, and say so")
cache_value(CMAKE_BUILD_TYPE build_type)
if(NOT build_type STREQUAL "" AND NOT build_type MATCHES "^CMAKE_BUILD_TYPE:[A-Z]*=$")
  message(FATAL_ERROR "kvlite set the host's build type: ${build_type}")
endif()
cache_value(CMAKE_CUDA_ARCHITECTURES cuda_architectures)
if(NOT cuda_architectures STREQUAL "")
  message(FATAL_ERROR "kvlite put CUDA architectures in the host's cache: ${cuda_architectures}")
endif()
message(STATUS "guest: CUDA off, host build type '${build_type}' (unset), no CMAKE_CUDA_ARCHITECTURES in the cache")

# 2. Asked for CUDA, with one architecture: on, for that architecture only, still nothing in the host's cache.
if(WITH_NVCC)
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/guest -B ${work}/build-cuda -DKVLITE_SOURCE_DIR=${SOURCE_DIR}
      -DKVLITE_CUDA=ON -DKVLITE_CUDA_ARCHITECTURES=86-real)
  expect("${last_output}" "kvlite: CUDA backend ON \\(KVLITE_CUDA=ON\\), architectures 86-real"
         "KVLITE_CUDA=ON KVLITE_CUDA_ARCHITECTURES=86-real")
  file(STRINGS ${work}/build-cuda/CMakeCache.txt lines REGEX "^CMAKE_CUDA_ARCHITECTURES:")
  if(NOT lines STREQUAL "")
    message(FATAL_ERROR "kvlite put CUDA architectures in the host's cache: ${lines}")
  endif()
  message(STATUS "guest: KVLITE_CUDA=ON with KVLITE_CUDA_ARCHITECTURES=86-real configures for sm_86 only")
endif()

# 3. The host's app builds against kvlite::kvlite and runs.
run(${CMAKE_COMMAND} --build ${work}/build -j 2 --target host_app)
run(${work}/build/host_app ${SOURCE_DIR}/models/llama-3.1-8b-instruct-w4a16)
expect("${last_output}" "kv_bytes_per_token=131072 fits=1" "the host's app")
message(STATUS "guest: the host's app runs: ${last_output}")
