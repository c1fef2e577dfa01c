# Checks the rooms of the library (DESIGN.md §2: each layer uses only the ones listed before
# it): every header under include/moebius/<area>/ and every source under src/<area>/ may
# include Moebius headers only from the areas allowed below. Fails naming the file, the
# include and the rule. Run: cmake -DSOURCE_DIR=<repo> -P check_layering.cmake
#
# cuda/ holds device-only declarations (checks, kernel launchers) for the areas that run on
# the device. The rule that matters most: switch/ never includes policy/ (policy sits above the switcher
# and consumes its reports).

cmake_minimum_required(VERSION 3.25)
set(allowed_detail    "detail")
set(allowed_layout    "detail;layout")
set(allowed_plan      "detail;layout;plan")
set(allowed_kv        "detail;layout;plan;kv;cuda")
set(allowed_memory    "detail;layout;plan;kv;memory;cuda")
set(allowed_transport "detail;layout;plan;kv;memory;transport;cuda")
set(allowed_switch    "detail;layout;plan;kv;memory;transport;switch")
set(allowed_policy    "detail;layout;plan;kv;memory;transport;switch;policy")

set(failures "")
foreach(area detail layout plan kv memory transport switch policy)
  file(GLOB_RECURSE files "${SOURCE_DIR}/include/moebius/${area}/*.hpp"
                          "${SOURCE_DIR}/src/${area}/*.cpp" "${SOURCE_DIR}/src/${area}/*.hpp")
  foreach(f IN LISTS files)
    file(STRINGS "${f}" includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]moebius/")
    foreach(line IN LISTS includes)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]moebius/([^\">]*)[\">].*$" "\\1"
             target "${line}")
      if(target MATCHES "^([a-z_0-9]+)/")
        set(to "${CMAKE_MATCH_1}")
      else()
        continue()  # moebius/error.hpp, moebius/config.hpp: allowed everywhere
      endif()
      if(NOT to IN_LIST allowed_${area})
        file(RELATIVE_PATH rel "${SOURCE_DIR}" "${f}")
        string(APPEND failures "  ${rel} includes moebius/${target}: ${area}/ may include only "
                               "${allowed_${area}}\n")
      endif()
    endforeach()
  endforeach()
endforeach()

if(failures)
  message(FATAL_ERROR "layering: includes across rooms that DESIGN.md §2 forbids:\n${failures}")
endif()
message(STATUS "layering: ok")
