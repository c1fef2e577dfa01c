#include "run_report.hpp"

#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>

#include "percentile.hpp"

namespace mini_engine {

namespace {

// A CSV field (RFC 4180): quoted, with its quotes doubled, when it holds a comma, a quote or a
// line break ("GPU runtime, measured" is one field).
std::string csv_field(const std::string& v) {
  if (v.find_first_of(",\"\r\n") == std::string::npos) return v;
  std::string q = "\"";
  for (const char ch : v) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return q + "\"";
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const decision_record& d) {
  os << "step " << d.step << " at " << d.now_s << " s in " << moebius::to_string(d.mode)
     << ": load " << d.load << " (" << d.running << " running, " << d.waiting << " waiting"
     << (d.admission_blocked ? ", admission blocked" : "") << "): " << d.decision;
  if (d.gate.evaluated) os << "; " << d.gate;
  if (d.repeats > 0) os << " (and the same on " << d.repeats << " more steps)";
  return os;
}

run_summary summarize(const run_result& r) {
  run_summary s;
  s.requests = static_cast<int64_t>(r.requests.size());
  s.steps = static_cast<int64_t>(r.steps.size());
  s.duration_s = r.end_s;
  std::vector<double> ttft, tpot;
  double tpot_sum = 0;
  int64_t tpot_n = 0;
  for (const request_result& q : r.requests) {
    s.output_tokens += static_cast<int64_t>(q.generated.size());
    if (q.first_token_s >= 0) ttft.push_back(q.ttft_s() * 1e3);
    if (q.finished() && q.output_tokens > 1) {
      tpot_sum += q.tpot_s() * 1e3;
      tpot.push_back(q.tpot_s() * 1e3);
      ++tpot_n;
    }
  }
  if (!ttft.empty()) {
    double sum = 0;
    for (double x : ttft) sum += x;
    s.mean_ttft_ms = sum / static_cast<double>(ttft.size());
    s.p99_ttft_ms = p99(std::move(ttft));
  }
  s.mean_tpot_ms = tpot_n > 0 ? tpot_sum / static_cast<double>(tpot_n) : 0;
  s.p99_tpot_ms = p99(std::move(tpot));
  // Throughput over the time requests were present: first arrival to last finish.
  double first_arrival = r.end_s;
  for (const request_result& q : r.requests)
    if (!q.failed()) first_arrival = std::min(first_arrival, q.arrival_s);
  const double span = r.end_s - first_arrival;
  s.tokens_per_s = span > 0 ? static_cast<double>(s.output_tokens) / span : 0;
  for (const switch_record& w : r.switches) {
    if (w.outcome != moebius::switch_outcome::committed) continue;
    ++s.switches;
    s.switch_total_ms += w.clock_ms;
  }
  s.switch_mean_ms = s.switches > 0 ? s.switch_total_ms / static_cast<double>(s.switches) : 0;
  return s;
}

void write_steps_csv(std::ostream& os, const run_result& r) {
  os << "run,step,start_s,mode,sequences,decode_tokens,prefill_tokens,context_tokens,running,"
        "waiting,stalled,preempted,kv_used_pages,step_ms,measured_ms,switched,switch_ms,config,"
        "decodes_held\n";
  char buf[320];
  for (const step_record& s : r.steps) {
    std::snprintf(
        buf, sizeof buf,
        "%lld,%.6f,%s,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%.4f,%.4f,%d,%.4f,%s,%lld\n",
        static_cast<long long>(s.step), s.start_s, moebius::to_string(s.mode),
        static_cast<long long>(s.sequences), static_cast<long long>(s.decode_tokens),
        static_cast<long long>(s.prefill_tokens), static_cast<long long>(s.context_tokens),
        static_cast<long long>(s.running), static_cast<long long>(s.waiting),
        static_cast<long long>(s.stalled), static_cast<long long>(s.preempted),
        static_cast<long long>(s.kv_used_pages), s.step_ms, s.measured_ms, s.switched ? 1 : 0,
        s.switch_ms, name_of(s.config).c_str(), static_cast<long long>(s.decodes_held));
    os << csv_field(r.name) << ',' << buf;
  }
}

void write_requests_csv(std::ostream& os, const run_result& r, bool header) {
  if (header)
    os << "run,id,arrival_s,admitted_s,first_token_s,finish_s,prompt_tokens,output_tokens,"
          "preemptions,failed\n";
  char buf[320];
  for (const request_result& q : r.requests) {
    std::snprintf(buf, sizeof buf, "%lld,%.6f,%.6f,%.6f,%.6f,%lld,%lld,%lld,%d\n",
                  static_cast<long long>(q.id), q.arrival_s, q.admitted_s,
                  q.first_token_s, q.finish_s, static_cast<long long>(q.prompt_tokens),
                  static_cast<long long>(q.output_tokens), static_cast<long long>(q.preemptions),
                  q.failed() ? 1 : 0);
    os << csv_field(r.name) << ',' << buf;
  }
}

}  // namespace mini_engine
