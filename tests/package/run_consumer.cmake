# Installs the Moebius build at MOEBIUS_BUILD_DIR into WORK_DIR/prefix, then configures,
# builds and runs the consumer project at CONSUMER_SOURCE_DIR against it.
file(REMOVE_RECURSE "${WORK_DIR}")

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test: ${what} failed (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "package test: ${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

run_step("install" ${CMAKE_COMMAND} --install "${MOEBIUS_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
set(cuda_arg "")
if(CUDA_COMPILER)
  get_filename_component(cuda_bin "${CUDA_COMPILER}" DIRECTORY)
  set(cuda_arg "-DCUDAToolkit_ROOT=${cuda_bin}/..")
endif()
run_step("configure consumer" ${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build"
         -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" ${cuda_arg})
run_step("build consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run_step("run consumer" "${WORK_DIR}/build/moebius_consumer")
if(NOT step_output MATCHES "consumer: ok")
  message(FATAL_ERROR "package test: consumer did not report success:\n${step_output}")
endif()
message(STATUS "${step_output}")
