// TEMPORARY (see stub/kv_pages.hpp): Catch2 v2's main for the stand-in CMakeLists.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
