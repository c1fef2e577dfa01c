#pragma once

// Hearing about every switch: one callback per process that an engine installs (its logger,
// its metrics exporter), called by every switcher when a switch ends, with the final report.
//
//   set_switch_observer([](const switch_event& e) {
//     log.info("moebius switch #{} {}: {}", e.sequence, to_string(e.style), e.report);
//     for_each_metric(e.report, [](std::string_view n, double v) { gauges[n].set(v); });
//   });
//
// "Ends" means: switcher::switch_to() returns (any outcome, already_there and the refusals
// included), or a progressive switch closes (finish(), abort(), an advance that failed, or
// begin() that did not open one). A switch in progress is never reported; one switch is
// reported exactly once. The observer runs on the thread that ended the switch, after the
// report is final (the switcher's last_report()) and before the call that ended it returns,
// so it must be quick and must not call back into that switcher. Reporting never fails a
// switch: whatever the observer throws is dropped.
//
// Process-wide rather than per switcher so that a logger is installed once, where the engine
// sets up logging, and hears every switcher of the process (Python's `logging` in the module).

#include <cstdint>
#include <functional>

#include "moebius/switch/switch_report.hpp"

namespace moebius {

enum class switch_style : uint8_t {
  whole,        // switcher::switch_to(): stop the world
  progressive,  // switcher::begin() ... finish() / abort()
};

constexpr const char* to_string(switch_style s) {
  return s == switch_style::whole ? "whole" : "progressive";
}

struct switch_event {
  const switch_report& report;  // final; valid during the call only (copy what you keep)
  switch_style style;
  int64_t sequence;  // 1, 2, ... per process in the order switches ended: a log's switch id
};

using switch_observer = std::function<void(const switch_event&)>;

// Installs `observer` for every switcher of the process (an empty function: none) and returns
// the one it replaces. Thread-safe; a switch that is ending while it is replaced sees either.
switch_observer set_switch_observer(switch_observer observer);

// Reports a switch that ended to the installed observer, numbering it; what the switcher
// calls. Never throws.
void notify_switch_observer(const switch_report& report, switch_style style) noexcept;

}  // namespace moebius
