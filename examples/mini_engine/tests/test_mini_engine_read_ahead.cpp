// file_read_ahead (read_ahead.hpp): reads a file on its own thread, never more than its lead
// past what the consumer reported, to the end of the file, and stops when destroyed; a file
// it cannot open reads nothing and throws nothing.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "read_ahead.hpp"

using namespace mini_engine;
namespace fs = std::filesystem;

namespace {

// Waits up to 10 s for `done`; a reader that never gets there fails the test, not hangs it.
template <class F>
bool eventually(F&& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

TEST_CASE("file_read_ahead reads ahead of its consumer by its lead, to the end", "[read_ahead]") {
  std::mt19937_64 rng(std::random_device{}());
  const int64_t chunk = 4096 * (1 + static_cast<int64_t>(rng() % 4));
  const int64_t size =
      chunk * (20 + static_cast<int64_t>(rng() % 20)) + static_cast<int64_t>(rng() % chunk);
  const int64_t lead = chunk * (2 + static_cast<int64_t>(rng() % 4));
  INFO("size " << size << " chunk " << chunk << " lead " << lead);
  const fs::path path =
      fs::temp_directory_path() / ("mini_engine_ra_" + std::to_string(::getpid()));
  {
    std::ofstream out(path, std::ios::binary);
    const std::vector<char> bytes(static_cast<size_t>(size), 'x');
    out.write(bytes.data(), static_cast<std::streamsize>(size));
  }
  {
    file_read_ahead ahead(path.string(), lead, chunk);
    // Nothing consumed: it reads up to the lead (whole chunks, so at most one chunk past it).
    REQUIRE(eventually([&] { return ahead.bytes_read() >= lead; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // and no further
    CHECK(ahead.bytes_read() < lead + chunk);
    CHECK_FALSE(ahead.finished());
    // The consumer moves: the reader follows, still bounded by the lead.
    const int64_t at = size / 3;
    ahead.consumed(at);
    REQUIRE(eventually([&] { return ahead.bytes_read() >= at + lead; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(ahead.bytes_read() < at + lead + chunk);
    ahead.consumed(at - chunk);  // going back changes nothing
    // Near the end: it reads the whole file and stops.
    ahead.consumed(size);
    REQUIRE(eventually([&] { return ahead.finished(); }));
    CHECK(ahead.bytes_read() == size);
  }
  {
    // Destroyed while it waits: the destructor returns (joins the waiting thread).
    file_read_ahead ahead(path.string(), lead, chunk);
    REQUIRE(eventually([&] { return ahead.bytes_read() >= lead; }));
  }
  {
    file_read_ahead off(path.string(), 0, chunk);  // no lead: no thread, nothing read
    CHECK(off.finished());
    CHECK(off.bytes_read() == 0);
  }
  fs::remove(path);
  file_read_ahead missing(path.string(), lead, chunk);  // cannot open: quietly nothing
  CHECK(missing.finished());
  CHECK(missing.bytes_read() == 0);
}
