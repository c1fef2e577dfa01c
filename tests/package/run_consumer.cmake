# Installs the Moebius build at MOEBIUS_BUILD_DIR into WORK_DIR/prefix, then configures,
# builds and runs the consumer projects against it:
#   consumer/       the host component only. It must not find the CUDA Toolkit nor link the
#                   CUDA runtime or NCCL: checked on its CMake cache, its link command and
#                   (where ldd exists) the executable's dynamic dependencies.
#   consumer_cuda/  COMPONENTS cuda (and nccl when WITH_NCCL), when Moebius was built with CUDA.
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

# --- host-only consumer ----------------------------------------------------------------------
set(host_build "${WORK_DIR}/host")
run_step("configure host consumer" ${CMAKE_COMMAND} -S "${SOURCE_DIR}/consumer" -B "${host_build}"
         -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
run_step("build host consumer" ${CMAKE_COMMAND} --build "${host_build}" --verbose)
set(link_log "${step_output}")
run_step("run host consumer" "${host_build}/moebius_consumer")
if(NOT step_output MATCHES "consumer: ok")
  message(FATAL_ERROR "package test: host consumer did not report success:\n${step_output}")
endif()
file(STRINGS "${host_build}/CMakeCache.txt" toolkit_entries REGEX "^CUDAToolkit_|^NCCL_")
if(toolkit_entries)
  message(FATAL_ERROR "package test: find_package(Moebius) without components looked for the "
                      "CUDA Toolkit or NCCL:\n${toolkit_entries}")
endif()
if(link_log MATCHES "cudart|libnccl|-lnccl|libcuda")
  message(FATAL_ERROR "package test: the host-only consumer links the CUDA runtime or NCCL:\n"
                      "${link_log}")
endif()
find_program(LDD ldd)
if(LDD)
  execute_process(COMMAND ${LDD} "${host_build}/moebius_consumer" OUTPUT_VARIABLE deps
                  ERROR_QUIET)
  if(deps MATCHES "cudart|nccl|libcuda")
    message(FATAL_ERROR "package test: the host-only consumer depends on CUDA/NCCL:\n${deps}")
  endif()
endif()
message(STATUS "package test: host consumer links no CUDA runtime nor NCCL")

# --- CUDA (and NCCL) consumer ----------------------------------------------------------------
if(WITH_CUDA)
  get_filename_component(cuda_bin "${CUDA_COMPILER}" DIRECTORY)
  set(cuda_build "${WORK_DIR}/cuda")
  run_step("configure CUDA consumer" ${CMAKE_COMMAND} -S "${SOURCE_DIR}/consumer_cuda"
           -B "${cuda_build}" -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
           "-DCUDAToolkit_ROOT=${cuda_bin}/.." "-DWITH_NCCL=${WITH_NCCL}")
  run_step("build CUDA consumer" ${CMAKE_COMMAND} --build "${cuda_build}")
  run_step("run CUDA consumer" "${cuda_build}/moebius_consumer")
  if(NOT step_output MATCHES "consumer: ok")
    message(FATAL_ERROR "package test: CUDA consumer did not report success:\n${step_output}")
  endif()
endif()
