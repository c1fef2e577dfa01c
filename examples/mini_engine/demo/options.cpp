#include "options.hpp"

#include <fstream>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>

namespace mini_engine::demo {

namespace {

[[noreturn]] void fail(const std::string& option, const std::string& why) {
  throw usage_error(option + ": " + why);
}

int64_t parse_int(const std::string& option, std::string_view v, int64_t lo, int64_t hi) {
  int64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec == std::errc::invalid_argument || end != v.data() + v.size()) {
    fail(option, "'" + std::string(v) + "' is not an integer");
  }
  if (ec == std::errc::result_out_of_range || x < lo || x > hi) {
    fail(option, std::string(v) + " is out of range [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  }
  return x;
}

uint64_t parse_seed(const std::string& option, std::string_view v) {
  uint64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
    fail(option, "'" + std::string(v) + "' is not an unsigned 64-bit integer");
  }
  return x;
}

double parse_double(const std::string& option, std::string_view v, double lo, double hi) {
  const std::string s(v);
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || s.front() == ' ') {
    fail(option, "'" + s + "' is not a number");
  }
  if (!std::isfinite(x) || x < lo || x > hi) {
    fail(option, s + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return x;
}

}  // namespace

const char* to_string(trace_kind t) {
  switch (t) {
    case trace_kind::bursty: return "bursty";
    case trace_kind::rollout: return "rollout";
    case trace_kind::steady: return "steady";
    case trace_kind::production: return "production";
    case trace_kind::file: return "file";
  }
  return "unknown";
}

const char* to_string(priced_kind m) {
  return m == priced_kind::qwen3_30b_a3b ? "Qwen3-30B-A3B" : "Qwen3-235B-A22B";
}

const char* usage_text() {
  return "usage: moebius_demo [options]\n"
         "Serves each request trace four times on the mini-engine (static TP, static EP, and\n"
         "switching live between them with the Moebius policy and its cost gate, stop-the-world\n"
         "and progressive), then prints a table per trace with the best static run beside\n"
         "switching, and writes a CSV and an SVG timeline per trace. Without GPUs it runs the host runtime (small model, P\n"
         "virtual ranks) and prices each step with an H200 model (the clock it shows); with\n"
         "GPUs (a CUDA build) the GPU runtime serves the small model on P = min(GPUs, 2)\n"
         "ranks (one GPU: 2 virtual ranks on it), each step timed with CUDA events (the\n"
         "measured clock).\n"
         "  --runtime auto|host|gpu  which runtime (auto: gpu when GPUs are present)\n"
         "  --ranks P                host ranks, 1..64 (default 8; the model must split over P)\n"
         "  --gpu-ranks P            GPU runtime ranks, 1..8 (default 2: one per GPU, or\n"
         "                           virtual); more than the GPUs: virtual ranks on GPU 0\n"
         "  --trace all|bursty|rollout|steady|production|FILE  the workload (default all: the\n"
         "                           four in turn; FILE: .jsonl, or text lines 'arrival_s prompt\n"
         "                           output'; may be repeated)\n"
         "  --model qwen3-235b-a22b|qwen3-30b-a3b  the model the H200 clock prices\n"
         "                           (default qwen3-235b-a22b)\n"
         "  --model DIR              serve a Hugging Face Qwen3-MoE checkpoint directory\n"
         "                           (config.json, model.safetensors or shards with\n"
         "                           model.safetensors.index.json) instead of the random\n"
         "                           model, on the host runtime or the GPU runtime (--runtime;\n"
         "                           needs a build with the host runtime); one progress line\n"
         "                           per shard\n"
         "  --no-gate                switching runs without the cost gate (the rules alone)\n"
         "  --write-trace FILE       write the one --trace given as JSONL to FILE and exit\n"
         "  --seed N                 seed of the trace and the weights (default 1)\n"
         "  --duration S             bursty/steady/production length in seconds, (0, 3600]\n"
         "                           (default: each trace's own)\n"
         "  --requests N             rollout batch, 1..100000 (default 512)\n"
         "  --kv-pages N             EP KV pages per rank, 1..16777216 (default: what an H200\n"
         "                           holds for the priced model after its weights)\n"
         "  --max-batch N            sequences running at once, 1..4096 (default 512)\n"
         "  --step-tokens N          token budget per step, 1..65536 (default 1024)\n"
         "  --clock auto|model|measured  step times: H200 model (host default) or measured\n"
         "                           (GPU default)\n"
         "  --context-scale X        H200 model: context tokens priced x X, [1, 1024] (32)\n"
         "  --curves FILE|roofline   H200 model: decode steps from measured per-rank curves\n"
         "                           (bench_mini_engine_rank_share's JSON lines), or from the\n"
         "                           roofline (default: the priced deployment's curves under\n"
         "                           docs/results, compiled in, when there are any)\n"
         "  --out DIR                where the CSV and SVG go (default moebius_demo_out)\n"
         "  --no-reshard             skip the verified-reshard stage\n"
         "  --help                   this text\n";
}

options parse_options(int argc, const char* const* argv) {
  options o;
  bool max_batch_set = false, trace_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) fail(a, "needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      o.help = true;
    } else if (a == "--runtime") {
      const std::string_view v = value();
      if (v == "auto") o.runtime = runtime_kind::automatic;
      else if (v == "host") o.runtime = runtime_kind::host;
      else if (v == "gpu") o.runtime = runtime_kind::gpu;
      else fail(a, "'" + std::string(v) + "' is not one of auto, host, gpu");
    } else if (a == "--ranks") {
      o.ranks = static_cast<int>(parse_int(a, value(), 1, 64));
    } else if (a == "--gpu-ranks") {
      o.gpu_ranks = static_cast<int>(parse_int(a, value(), 1, 8));
    } else if (a == "--trace") {
      const std::string_view v = value();
      if (!trace_set) o.traces.clear();
      trace_set = true;
      o.traces_given = true;
      if (v == "all") {
        o.traces = {trace_kind::bursty, trace_kind::rollout, trace_kind::steady,
                    trace_kind::production};
      } else if (v == "bursty") o.traces.push_back(trace_kind::bursty);
      else if (v == "rollout") o.traces.push_back(trace_kind::rollout);
      else if (v == "steady") o.traces.push_back(trace_kind::steady);
      else if (v == "production") o.traces.push_back(trace_kind::production);
      else if (v.empty()) fail(a, "needs all, bursty, rollout, steady, production or a file name");
      else {
        if (!o.trace_file.empty()) fail(a, "one trace file at most");
        o.traces.push_back(trace_kind::file);
        o.trace_file = std::string(v);
      }
    } else if (a == "--model") {
      const std::string_view v = value();
      if (v == "qwen3-235b-a22b") o.priced = priced_kind::qwen3_235b_a22b;
      else if (v == "qwen3-30b-a3b") o.priced = priced_kind::qwen3_30b_a3b;
      else if (std::filesystem::is_directory(std::string(v))) o.model_dir = std::string(v);
      else fail(a, "'" + std::string(v) + "' is not one of qwen3-235b-a22b, qwen3-30b-a3b, nor a "
                   "checkpoint directory");
    } else if (a == "--no-gate") {
      o.gate = false;
    } else if (a == "--write-trace") {
      const std::string_view v = value();
      if (v.empty()) fail(a, "needs a file name");
      o.write_trace = std::string(v);
    } else if (a == "--seed") {
      o.seed = parse_seed(a, value());
    } else if (a == "--duration") {
      o.duration_s = parse_double(a, value(), 0, 3600);
      if (o.duration_s <= 0) fail(a, "must be > 0");
    } else if (a == "--requests") {
      o.requests = parse_int(a, value(), 1, 100000);
    } else if (a == "--kv-pages") {
      o.kv_pages = parse_int(a, value(), 1, int64_t{1} << 24);
    } else if (a == "--max-batch") {
      o.max_batch = parse_int(a, value(), 1, 4096);
      max_batch_set = true;
    } else if (a == "--step-tokens") {
      o.step_tokens = parse_int(a, value(), 1, 65536);
    } else if (a == "--clock") {
      const std::string_view v = value();
      if (v == "auto") o.clock = clock_kind::automatic;
      else if (v == "model") o.clock = clock_kind::model;
      else if (v == "measured") o.clock = clock_kind::measured;
      else fail(a, "'" + std::string(v) + "' is not one of auto, model, measured");
    } else if (a == "--context-scale") {
      o.context_scale = parse_double(a, value(), 1, 1024);
    } else if (a == "--curves") {
      o.curves = std::string(value());
      if (o.curves != "roofline" && !std::ifstream(o.curves).good())
        fail(a, "cannot open " + o.curves);
    } else if (a == "--out") {
      const std::string_view v = value();
      if (v.empty()) fail(a, "needs a directory name");
      o.out_dir = std::string(v);
    } else if (a == "--no-reshard") {
      o.reshard_stage = false;
    } else {
      throw usage_error("unknown option '" + a + "'");
    }
  }
  if (!o.curves.empty() && o.clock == clock_kind::measured) {
    fail("--curves", "step curves price the modelled clock, and --clock measured measures its "
                     "steps (--clock model uses them)");
  }
  if (!o.write_trace.empty() && o.traces.size() != 1) {
    fail("--write-trace", "needs exactly one --trace");
  }
  if (o.max_batch > o.step_tokens) {
    if (max_batch_set) {
      fail("--max-batch", std::to_string(o.max_batch) + " exceeds --step-tokens " +
                              std::to_string(o.step_tokens) +
                              " (every running sequence decodes one token per step)");
    }
    o.max_batch = o.step_tokens;
  }
  return o;
}

}  // namespace mini_engine::demo
