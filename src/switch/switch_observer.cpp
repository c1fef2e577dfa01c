#include "moebius/switch/switch_observer.hpp"

#include <atomic>
#include <memory>
#include <mutex>
#include <utility>

namespace moebius {
namespace {

// The observer is shared, not copied, out of the lock: a call in flight keeps the one it
// started with alive while another thread installs a new one.
std::mutex observer_mutex;
std::shared_ptr<const switch_observer> installed;  // null: none
std::atomic<int64_t> switches_ended{0};

}  // namespace

switch_observer set_switch_observer(switch_observer observer) {
  std::shared_ptr<const switch_observer> next;
  if (observer) next = std::make_shared<const switch_observer>(std::move(observer));
  std::shared_ptr<const switch_observer> previous;
  {
    const std::lock_guard<std::mutex> lock(observer_mutex);
    previous = std::exchange(installed, std::move(next));
  }
  return previous ? *previous : switch_observer{};
}

void notify_switch_observer(const switch_report& report, switch_style style) noexcept {
  const int64_t sequence = ++switches_ended;
  std::shared_ptr<const switch_observer> observer;
  {
    const std::lock_guard<std::mutex> lock(observer_mutex);
    observer = installed;
  }
  if (!observer) return;
  try {
    (*observer)(switch_event{report, style, sequence});
  } catch (...) {  // reporting never fails a switch (switch_observer.hpp)
  }
}

}  // namespace moebius
