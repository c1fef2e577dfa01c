#pragma once

// One check for every enum a caller hands in. An enum class cast from an out-of-range integer
// (`static_cast<parallel_mode>(7)`) is representable but names nothing: a ternary reads it as
// some other value and a table indexed by it reads past its end. Each public enum defines
// `constexpr bool is_valid(E)` beside itself (found by argument-dependent lookup); every public
// entry that takes an enum, directly or inside a descriptor, calls check_enum() once.
//   check_enum(static_cast<parallel_mode>(7), "switch_to target (parallel_mode)")
//     -> throws errc::invalid_argument "switch_to target (parallel_mode) is out of range
//        (value 7)"

#include <type_traits>

#include "moebius/error.hpp"

namespace moebius::detail {

template <class Enum>
void check_enum(Enum value, const char* what) {
  static_assert(std::is_enum_v<Enum>, "check_enum takes an enum");
  MOEBIUS_CHECK(is_valid(value), errc::invalid_argument, what, " is out of range (value ",
                static_cast<long long>(static_cast<std::underlying_type_t<Enum>>(value)), ")");
}

}  // namespace moebius::detail
