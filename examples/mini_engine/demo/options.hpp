#pragma once

// moebius_demo's command line, parsed strictly: every value is checked for its type (no
// trailing garbage: `4x`, `2.9` for an integer), its range and, for sizes, the memory it
// implies before anything is allocated. A bad command line throws usage_error, which main()
// reports with exit status 2.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mini_engine::demo {

class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class runtime_kind : uint8_t { automatic, host, gpu };
enum class trace_kind : uint8_t { bursty, rollout, file };
enum class clock_kind : uint8_t { automatic, model, measured };

struct options {
  runtime_kind runtime = runtime_kind::automatic;
  int ranks = 4;                 // P (virtual ranks on the host)
  // P of the GPU runtime; 0: 2 (one per GPU with two GPUs or more, virtual on one GPU). More
  // than the GPUs: virtual ranks (all on GPU 0).
  int gpu_ranks = 0;
  trace_kind trace = trace_kind::bursty;
  std::string trace_file;        // trace_kind::file
  uint64_t seed = 1;
  double duration_s = 1.0;       // bursty: length of the trace on the serving clock
  int64_t requests = 160;        // rollout: the batch
  int64_t kv_pages = 2048;       // EP KV pages per rank
  int64_t max_batch = 128;       // sequences running at once
  int64_t step_tokens = 512;     // token budget per step (chunked prefill)
  clock_kind clock = clock_kind::automatic;
  double context_scale = 32;     // H200 model: each context token priced as this many
  std::string out_dir = "moebius_demo_out";
  bool reshard_stage = true;
  bool help = false;
};

// Parses argv[1..argc). Throws usage_error with a message naming the option and the value.
options parse_options(int argc, const char* const* argv);

// The --help text.
const char* usage_text();

}  // namespace mini_engine::demo
