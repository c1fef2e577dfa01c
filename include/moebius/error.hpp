#pragma once

// One error model for the whole library: host code throws moebius::error, which carries a
// status code, the source location and a message that names the broken constraint and the
// values that broke it. Device code asserts only in debug builds.

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace moebius {

enum class errc : int {
  invalid_argument = 1,  // a shape, view or plan that violates a documented constraint
  overflow,              // a byte count or offset that does not fit in 64 bits
  out_of_range,          // an index or offset outside the memory it refers to
  capacity,              // the target layout cannot hold what must move into it
  cuda,                  // a CUDA runtime or driver call failed
  nccl,                  // an NCCL call failed
  timeout,               // a peer did not arrive at a barrier in time
  injected_fault,        // a fault injected by a test hook
  internal,              // a broken internal invariant: a Moebius bug
};

constexpr const char* to_string(errc code) noexcept {
  switch (code) {
    case errc::invalid_argument: return "invalid_argument";
    case errc::overflow: return "overflow";
    case errc::out_of_range: return "out_of_range";
    case errc::capacity: return "capacity";
    case errc::cuda: return "cuda";
    case errc::nccl: return "nccl";
    case errc::timeout: return "timeout";
    case errc::injected_fault: return "injected_fault";
    case errc::internal: return "internal";
  }
  return "unknown";
}

class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message, const char* file, int line)
      : std::runtime_error(message), code_(code), file_(file), line_(line) {}

  errc code() const noexcept { return code_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  errc code_;
  const char* file_;
  int line_;
};

namespace detail {

// Builds "moebius <code>: <message parts> (<file>:<line>)" and throws.
template <class... Parts>
[[noreturn]] void throw_error(errc code, const char* file, int line, Parts&&... parts) {
  std::ostringstream message;
  message << "moebius " << to_string(code) << ": ";
  (message << ... << std::forward<Parts>(parts));
  message << " (" << file << ':' << line << ')';
  throw error(code, message.str(), file, line);
}

}  // namespace detail
}  // namespace moebius

// MOEBIUS_CHECK(cond, code, parts...): throws moebius::error(code) when cond is false. The
// message parts are streamed; name the constraint and the values:
//   MOEBIUS_CHECK(E % P == 0, errc::invalid_argument, "P must divide E (E=", E, ", P=", P, ")");
#define MOEBIUS_CHECK(cond, code, ...)                                                 \
  do {                                                                                 \
    if (!(cond)) [[unlikely]] {                                                        \
      ::moebius::detail::throw_error((code), __FILE__, __LINE__, __VA_ARGS__);         \
    }                                                                                  \
  } while (0)

#define MOEBIUS_FAIL(code, ...) ::moebius::detail::throw_error((code), __FILE__, __LINE__, __VA_ARGS__)
