# ctest driver: install the built library into a scratch prefix, build tests/consumer against it with
# find_package(kvlite), run it. Arguments: -DBUILD_DIR=... -DSOURCE_DIR=...
set(work ${BUILD_DIR}/consumer-check)
file(REMOVE_RECURSE ${work})
include(${SOURCE_DIR}/tests/check_run.cmake)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${work}/prefix)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${work}/build -DCMAKE_PREFIX_PATH=${work}/prefix)
run(${CMAKE_COMMAND} --build ${work}/build)
run(${work}/build/consumer ${SOURCE_DIR}/models/llama-3.1-8b-instruct-w4a16)
if(NOT last_output MATCHES "kv_bytes_per_token=131072 fits=1")
  message(FATAL_ERROR "unexpected consumer output: ${last_output}")
endif()
message(STATUS "consumer: ${last_output}")
