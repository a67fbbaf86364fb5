# Shared by the ctest drivers tests/guest/check.cmake and tests/consumer/check.cmake: run(COMMAND...) fails the
# test with the command's output unless it exits 0, and leaves its stdout in last_output.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "failed: ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()
