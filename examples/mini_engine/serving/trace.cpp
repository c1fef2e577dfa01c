#include "trace.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <fstream>
#include <istream>
#include <ostream>
#include <random>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

namespace {

constexpr int64_t max_tokens_per_field = int64_t{1} << 20;
constexpr int64_t max_rollout_step = int64_t{1} << 20;

void check_range(const char* what, int64_t lo, int64_t hi) {
  MOEBIUS_CHECK(lo >= 1 && lo <= hi, errc::invalid_argument, what,
                ": need 1 <= min <= max (min=", lo, ", max=", hi, ")");
}

void check_time(const char* what, double v, bool positive) {
  MOEBIUS_CHECK(std::isfinite(v) && (positive ? v > 0 : v >= 0), errc::invalid_argument, what,
                positive ? " must be finite and > 0 (got " : " must be finite and >= 0 (got ", v,
                ")");
}

// A request's own generator: prompts depend on (seed, id) only.
std::mt19937_64 request_rng(uint64_t seed, int64_t id) {
  std::seed_seq s{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                  static_cast<uint32_t>(id), static_cast<uint32_t>(static_cast<uint64_t>(id) >> 32),
                  0x70726f6du};
  return std::mt19937_64(s);
}

int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

}  // namespace

void validate(const bursty_options& o) {
  check_time("bursty duration_s", o.duration_s, false);
  check_time("bursty quiet_s", o.quiet_s, true);
  check_time("bursty burst_s", o.burst_s, true);
  check_time("bursty quiet_rate", o.quiet_rate, false);
  check_time("bursty burst_rate", o.burst_rate, false);
  check_range("bursty prompt tokens", o.prompt_min, o.prompt_max);
  check_range("bursty output tokens", o.output_min, o.output_max);
  MOEBIUS_CHECK(o.vocab >= 1, errc::invalid_argument, "vocab must be >= 1 (got ", o.vocab, ")");
}

void validate(const rollout_options& o) {
  MOEBIUS_CHECK(o.batch >= 0, errc::invalid_argument, "rollout batch must be >= 0 (got ",
                o.batch, ")");
  check_range("rollout prompt tokens", o.prompt_min, o.prompt_max);
  check_time("rollout output_median", o.output_median, true);
  check_time("rollout output_sigma", o.output_sigma, false);
  MOEBIUS_CHECK(o.output_max >= 1, errc::invalid_argument, "rollout output_max must be >= 1 (got ",
                o.output_max, ")");
  MOEBIUS_CHECK(o.vocab >= 1, errc::invalid_argument, "vocab must be >= 1 (got ", o.vocab, ")");
}

void validate(const steady_options& o) {
  check_time("steady duration_s", o.duration_s, false);
  check_time("steady rate", o.rate, false);
  check_range("steady prompt tokens", o.prompt_min, o.prompt_max);
  check_range("steady output tokens", o.output_min, o.output_max);
  MOEBIUS_CHECK(o.vocab >= 1, errc::invalid_argument, "vocab must be >= 1 (got ", o.vocab, ")");
}

void validate(const production_options& o) {
  check_time("production duration_s", o.duration_s, false);
  check_time("production mean_rate", o.mean_rate, false);
  check_time("production rate_sigma", o.rate_sigma, false);
  check_time("production rate_period_s", o.rate_period_s, true);
  check_time("production prompt_median", o.prompt_median, true);
  check_time("production prompt_sigma", o.prompt_sigma, false);
  check_time("production output_median", o.output_median, true);
  check_time("production output_sigma", o.output_sigma, false);
  check_time("production prompt_scale", o.prompt_scale, true);
  check_range("production prompt tokens", 1, o.prompt_max);
  check_range("production output tokens", 1, o.output_max);
  MOEBIUS_CHECK(o.vocab >= 1, errc::invalid_argument, "vocab must be >= 1 (got ", o.vocab, ")");
}

std::vector<int32_t> draw_prompt(uint64_t seed, int64_t id, int64_t num_tokens, int32_t vocab) {
  MOEBIUS_CHECK(num_tokens >= 0 && vocab >= 1, errc::invalid_argument,
                "draw_prompt: need num_tokens >= 0 and vocab >= 1 (got ", num_tokens, ", ", vocab,
                ")");
  std::mt19937_64 rng = request_rng(seed, id);
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::vector<int32_t> out(static_cast<size_t>(num_tokens));
  for (int32_t& t : out) t = token(rng);
  return out;
}

namespace {

// Request `id` arriving at `arrival_s` with prompt and output lengths uniform in the options'
// ranges (bursty and steady traces; the prompt's length is drawn first).
template <class Options>
request uniform_request(std::mt19937_64& rng, uint64_t seed, int64_t id, double arrival_s,
                        const Options& o) {
  request r;
  r.id = id;
  r.arrival_s = arrival_s;
  const int64_t prompt = uniform(rng, o.prompt_min, o.prompt_max);
  r.output_tokens = uniform(rng, o.output_min, o.output_max);
  r.prompt = draw_prompt(seed, r.id, prompt, o.vocab);
  return r;
}

}  // namespace

std::vector<request> bursty_trace(uint64_t seed, const bursty_options& o) {
  validate(o);
  std::mt19937_64 rng(seed);
  std::vector<request> out;
  // Alternate quiet and burst periods; arrivals in each are a Poisson process of its rate.
  double t = 0;
  bool burst = false;
  while (t < o.duration_s) {
    const double len = burst ? o.burst_s : o.quiet_s;
    const double rate = burst ? o.burst_rate : o.quiet_rate;
    const double end = std::min(t + len, o.duration_s);
    if (rate > 0) {
      std::exponential_distribution<double> gap(rate);
      for (double a = t + gap(rng); a < end; a += gap(rng)) {
        out.push_back(uniform_request(rng, seed, static_cast<int64_t>(out.size()), a, o));
      }
    }
    t = end;
    burst = !burst;
  }
  return out;
}

std::vector<request> rollout_trace(uint64_t seed, const rollout_options& o) {
  validate(o);
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> output(std::log(o.output_median), o.output_sigma);
  std::vector<request> out;
  for (int64_t i = 0; i < o.batch; ++i) {
    request r;
    r.id = i;
    r.arrival_s = 0;
    const int64_t prompt = uniform(rng, o.prompt_min, o.prompt_max);
    const double len = std::round(output(rng));
    r.output_tokens = std::clamp(static_cast<int64_t>(len), int64_t{1}, o.output_max);
    r.prompt = draw_prompt(seed, r.id, prompt, o.vocab);
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<request> steady_trace(uint64_t seed, const steady_options& o) {
  validate(o);
  std::mt19937_64 rng(seed);
  std::vector<request> out;
  if (o.rate <= 0) return out;
  std::exponential_distribution<double> gap(o.rate);
  for (double a = gap(rng); a < o.duration_s; a += gap(rng)) {
    out.push_back(uniform_request(rng, seed, static_cast<int64_t>(out.size()), a, o));
  }
  return out;
}

std::vector<request> production_trace(uint64_t seed, const production_options& o) {
  validate(o);
  std::mt19937_64 rng(seed);
  // A rate with median mean_rate / exp(sigma^2/2) has mean mean_rate.
  std::lognormal_distribution<double> rate_of(
      std::log(std::max(o.mean_rate, 1e-300)) - 0.5 * o.rate_sigma * o.rate_sigma, o.rate_sigma);
  std::lognormal_distribution<double> prompt_len(std::log(o.prompt_median / o.prompt_scale),
                                                 o.prompt_sigma);
  std::lognormal_distribution<double> output_len(std::log(o.output_median), o.output_sigma);
  std::vector<request> out;
  if (o.mean_rate <= 0) return out;
  for (double t = 0; t < o.duration_s; t += o.rate_period_s) {
    const double end = std::min(t + o.rate_period_s, o.duration_s);
    std::exponential_distribution<double> gap(rate_of(rng));
    for (double a = t + gap(rng); a < end; a += gap(rng)) {
      request r;
      r.id = static_cast<int64_t>(out.size());
      r.arrival_s = a;
      const int64_t prompt =
          std::clamp(static_cast<int64_t>(std::llround(prompt_len(rng))), int64_t{1}, o.prompt_max);
      r.output_tokens = std::clamp(static_cast<int64_t>(std::llround(output_len(rng))), int64_t{1},
                                   o.output_max);
      r.prompt = draw_prompt(seed, r.id, prompt, o.vocab);
      out.push_back(std::move(r));
    }
  }
  return out;
}

void write_trace_jsonl(std::ostream& os, const std::vector<request>& requests) {
  char buf[160];
  for (const request& r : requests) {
    int n = std::snprintf(buf, sizeof buf,
                          "{\"arrival_s\": %.6f, \"prompt_tokens\": %lld, \"output_tokens\": %lld",
                          r.arrival_s, static_cast<long long>(r.prompt.size()),
                          static_cast<long long>(r.output_tokens));
    if (r.rollout_step >= 0) {
      n += std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), ", \"rollout_step\": %lld",
                         static_cast<long long>(r.rollout_step));
    }
    if (r.max_new_tokens > 0) {
      n += std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), ", \"max_new_tokens\": %lld",
                         static_cast<long long>(r.max_new_tokens));
    }
    os << buf << "}\n";
  }
}

void write_trace(std::ostream& os, const std::vector<request>& requests) {
  os << "# arrival_s prompt_tokens output_tokens\n";
  char buf[96];
  for (const request& r : requests) {
    std::snprintf(buf, sizeof buf, "%.6f %lld %lld\n", r.arrival_s,
                  static_cast<long long>(r.prompt.size()), static_cast<long long>(r.output_tokens));
    os << buf;
  }
}

namespace {

// Splits `line` (comment removed) into whitespace-separated fields.
std::vector<std::string_view> fields_of(std::string_view line) {
  if (const size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    const size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') ++i;
    if (i > start) out.push_back(line.substr(start, i - start));
  }
  return out;
}

[[noreturn]] void bad_line(const std::string& source, int64_t line_no, const std::string& what) {
  MOEBIUS_CHECK(false, errc::invalid_argument, source, ":", line_no, ": ", what);
  std::abort();  // unreachable: MOEBIUS_CHECK(false) throws
}

int64_t parse_count(std::string_view f, const char* name, const std::string& source, int64_t line_no) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(f.data(), f.data() + f.size(), v);
  if (ec != std::errc() || end != f.data() + f.size()) {
    bad_line(source, line_no, std::string(name) + ": '" + std::string(f) + "' is not an integer");
  }
  if (v < 1 || v > max_tokens_per_field) {
    bad_line(source, line_no, std::string(name) + ": " + std::string(f) + " is outside [1, " +
                                  std::to_string(max_tokens_per_field) + "]");
  }
  return v;
}

double parse_time(std::string_view f, const std::string& source, int64_t line_no) {
  // strtod accepts what from_chars<double> does on every libstdc++ we build with; go through a
  // string so the end pointer tells us about trailing garbage.
  const std::string s(f);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) {
    bad_line(source, line_no, "arrival_s: '" + s + "' is not a number");
  }
  if (!std::isfinite(v) || v < 0) {
    bad_line(source, line_no, "arrival_s: " + s + " must be finite and >= 0");
  }
  return v;
}

}  // namespace

std::vector<request> read_trace(std::istream& is, uint64_t seed, int32_t vocab,
                                const std::string& source) {
  MOEBIUS_CHECK(vocab >= 1, errc::invalid_argument, "vocab must be >= 1 (got ", vocab, ")");
  std::vector<request> out;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(is, line)) {
    ++line_no;
    const std::vector<std::string_view> f = fields_of(line);
    if (f.empty()) continue;
    if (f.size() != 3) {
      bad_line(source, line_no,
               "expected 3 fields 'arrival_s prompt_tokens output_tokens', got " +
                   std::to_string(f.size()));
    }
    request r;
    r.id = static_cast<int64_t>(out.size());
    r.arrival_s = parse_time(f[0], source, line_no);
    const int64_t prompt = parse_count(f[1], "prompt_tokens", source, line_no);
    r.output_tokens = parse_count(f[2], "output_tokens", source, line_no);
    r.prompt = draw_prompt(seed, r.id, prompt, vocab);
    out.push_back(std::move(r));
  }
  MOEBIUS_CHECK(!is.bad(), errc::invalid_argument, source, ": read error after line ", line_no);
  std::stable_sort(out.begin(), out.end(),
                   [](const request& a, const request& b) { return a.arrival_s < b.arrival_s; });
  return out;
}

namespace {

// One JSONL line read through nlohmann/json's SAX interface: the object must be flat, with
// number members only, which it collects in order; every error names the line and, where there
// is one, the member. SAX rather than a parsed json value because it keeps what a value would
// lose: the text of a number ("2e3" is not an integer) and a member given twice.
class trace_line_reader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  // A member's value: an integer, or a float with its text as written.
  struct number {
    bool integral = false;
    int64_t integer = 0;     // integral
    double value = 0;        // !integral
    std::string text;        // as written (floats), or the integer printed
  };
  std::vector<std::pair<std::string, number>> members;  // in the line's order

  trace_line_reader(const std::string& source, int64_t line_no)
      : source_(source), line_(line_no) {}

  [[noreturn]] void fail(const std::string& what) const { bad_line(source_, line_, what); }

  bool null() override { return not_a_number("null"); }
  bool boolean(bool v) override { return not_a_number(v ? "true" : "false"); }
  bool number_integer(number_integer_t v) override {
    return value({true, v, static_cast<double>(v), std::to_string(v)});
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (v > static_cast<uint64_t>(INT64_MAX))
      return value({false, 0, static_cast<double>(v), std::to_string(v)});
    return number_integer(static_cast<int64_t>(v));
  }
  bool number_float(number_float_t v, const string_t& text) override {
    return value({false, 0, v, text});
  }
  bool string(string_t& v) override { return not_a_number("\"" + v + "\""); }
  bool binary(binary_t&) override { return not_a_number("binary"); }
  bool start_object(std::size_t) override {
    if (depth_ > 0) return not_a_number("an object");
    if (done_) fail("unexpected text after the object");
    ++depth_;
    return true;
  }
  bool key(string_t& name) override {
    key_ = name;
    in_value_ = true;
    return true;
  }
  bool end_object() override {
    --depth_;
    done_ = true;
    return true;
  }
  bool start_array(std::size_t) override { return not_a_number("an array"); }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& e) override {
    // nlohmann's message without its "[json.exception.parse_error.101] " prefix.
    std::string what = e.what();
    if (const size_t close = what.find("] "); what.front() == '[' && close != std::string::npos)
      what = what.substr(close + 2);
    if (done_) fail("unexpected text after the object: " + what);
    if (depth_ == 0) fail("expected a JSON object: " + what);
    if (in_value_) fail(key_ + ": not a JSON number: " + what);
    fail((key_.empty() ? std::string("in the object") : "after the value of \"" + key_ + "\"") +
         ": " + what);
  }

 private:
  bool value(const number& v) {
    if (depth_ == 0) fail("expected a JSON object, got '" + v.text + "'");
    in_value_ = false;
    members.emplace_back(key_, v);
    return true;
  }
  bool not_a_number(const std::string& what) {
    if (depth_ == 0) fail("expected a JSON object, got " + what);
    fail(key_ + ": '" + what + "' is not a JSON number");
  }

  const std::string& source_;
  int64_t line_;
  std::string key_;
  int depth_ = 0;
  bool in_value_ = false;  // a member's name is read, its value not yet
  bool done_ = false;      // the object is closed
};

bool blank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

}  // namespace

std::vector<request> read_trace_jsonl(std::istream& is, uint64_t seed, int32_t vocab,
                                      const std::string& source) {
  MOEBIUS_CHECK(vocab >= 1, errc::invalid_argument, "vocab must be >= 1 (got ", vocab, ")");
  // The three required members, then the optional ones.
  constexpr int num_names = 5;
  static constexpr const char* names[num_names] = {"arrival_s", "prompt_tokens", "output_tokens",
                                                   "rollout_step", "max_new_tokens"};
  std::vector<request> out;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(is, line)) {
    ++line_no;
    if (blank(line)) continue;
    bool seen[num_names] = {false, false, false, false, false};
    double arrival = 0;
    int64_t counts[num_names] = {0, 0, 0, -1, 0};
    trace_line_reader reader(source, line_no);
    nlohmann::json::sax_parse(line, &reader);
    for (const auto& [name, v] : reader.members) {
      int k = 0;
      while (k < num_names && name != names[k]) ++k;
      if (k == num_names) {
        reader.fail("unknown member \"" + name +
                    "\" (expected arrival_s, prompt_tokens, output_tokens, rollout_step, "
                    "max_new_tokens)");
      }
      if (seen[k]) reader.fail(name + ": appears twice");
      seen[k] = true;
      if (k == 0) {
        arrival = parse_time(v.text, source, line_no);
      } else if (!v.integral) {
        reader.fail(name + ": " + v.text + " is not an integer");
      } else if (k == 3) {
        if (v.integer < 0 || v.integer > max_rollout_step)
          reader.fail(name + ": " + v.text + " is outside [0, " +
                      std::to_string(max_rollout_step) + "]");
        counts[k] = v.integer;
      } else {
        counts[k] = parse_count(v.text, names[k], source, line_no);
      }
    }
    for (int k = 0; k < 3; ++k) {
      if (!seen[k]) reader.fail(std::string(names[k]) + ": missing");
    }
    if (seen[4] && counts[4] < counts[2]) {
      reader.fail("max_new_tokens: " + std::to_string(counts[4]) + " is below output_tokens " +
                  std::to_string(counts[2]) + " (a response never outgrows its client's limit)");
    }
    request r;
    r.id = static_cast<int64_t>(out.size());
    r.arrival_s = arrival;
    r.output_tokens = counts[2];
    r.rollout_step = counts[3];
    r.max_new_tokens = counts[4];
    r.prompt = draw_prompt(seed, r.id, counts[1], vocab);
    out.push_back(std::move(r));
  }
  MOEBIUS_CHECK(!is.bad(), errc::invalid_argument, source, ": read error after line ", line_no);
  // A rollout's steps in order, each by arrival; an open-loop trace by arrival.
  int64_t closed = 0;
  for (const request& r : out) closed += r.rollout_step >= 0;
  MOEBIUS_CHECK(closed == 0 || closed == static_cast<int64_t>(out.size()), errc::invalid_argument,
                source, ": ", closed, " of ", out.size(),
                " requests have a rollout_step: give every request one (a closed-loop rollout) "
                "or none (an open-loop trace)");
  std::stable_sort(out.begin(), out.end(), [](const request& a, const request& b) {
    return a.rollout_step != b.rollout_step ? a.rollout_step < b.rollout_step
                                            : a.arrival_s < b.arrival_s;
  });
  return out;
}

std::vector<request> read_trace_file(const std::string& path, uint64_t seed, int32_t vocab) {
  std::ifstream in(path);
  MOEBIUS_CHECK(in.good(), errc::invalid_argument, "cannot open trace file '", path, "'");
  const bool jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  return jsonl ? read_trace_jsonl(in, seed, vocab, path) : read_trace(in, seed, vocab, path);
}

}  // namespace mini_engine
