// main() for host test executables (Catch2 v2; v3 links Catch2WithMain instead).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
