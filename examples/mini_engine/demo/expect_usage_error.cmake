# Runs ${DEMO} ${ARGS} and fails unless it exits with status 2 and its stderr contains
# ${EXPECT}. Used by the moebius_demo_bad_option_* tests.
execute_process(COMMAND ${DEMO} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "moebius_demo ${ARGS}: exit status ${rc}, expected 2\nstdout: ${out}\nstderr: ${err}")
endif()
string(FIND "${err}" "${EXPECT}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "moebius_demo ${ARGS}: stderr lacks '${EXPECT}'\nstderr: ${err}")
endif()
message(STATUS "moebius_demo ${ARGS}: exit 2, '${err}'")
