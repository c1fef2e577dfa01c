// The progressive-switch session (moebius/switch/progressive.hpp): a handle on the switcher's
// open transaction (src/switch/transaction.hpp), closed when the switch ends.

#include "moebius/switch/progressive.hpp"

#include <algorithm>
#include <utility>

#include "moebius/error.hpp"
#include "moebius/switch/switch_observer.hpp"
#include "moebius/switch/switcher.hpp"
#include "switch_state.hpp"
#include "transaction.hpp"

namespace moebius {

const char* to_string(progress_state s) {
  switch (s) {
    case progress_state::in_flight: return "in_flight";
    case progress_state::ready: return "ready";
    case progress_state::ended: return "ended";
  }
  return "unknown";
}

bool layer_completion::contains(int64_t layer) const {
  return std::find(layers_.begin(), layers_.end(), layer) != layers_.end();
}

event_handle layer_completion::event(int64_t layer, size_t local_index) const {
  const auto it = std::find(layers_.begin(), layers_.end(), layer);
  MOEBIUS_CHECK(it != layers_.end() && local_index < num_local_, errc::out_of_range,
                "layer_completion::event(", layer, ", ", local_index, "): this advance moved ",
                layers_.size(), " layers (", layers_.empty() ? -1 : layers_.front(), "..",
                layers_.empty() ? -1 : layers_.back(), ") over ", num_local_, " local ranks");
  const auto j = static_cast<size_t>(it - layers_.begin());
  return events_[j * num_local_ + local_index];
}

step_layer_events::step_layer_events(int64_t num_layers, size_t num_local)
    : num_layers_(num_layers), num_local_(num_local) {
  MOEBIUS_CHECK(num_layers >= 1 && num_local >= 1, errc::invalid_argument,
                "step_layer_events: need >= 1 layer and >= 1 local rank (got ", num_layers, ", ",
                num_local, ")");
  events_.assign(static_cast<size_t>(num_layers) * num_local, nullptr);
}

void step_layer_events::set(int64_t layer, size_t local_index, event_handle e) {
  MOEBIUS_CHECK(layer >= 0 && layer < num_layers_ && local_index < num_local_, errc::out_of_range,
                "step_layer_events::set(", layer, ", ", local_index, "): ", num_layers_,
                " layers, ", num_local_, " local ranks");
  events_[static_cast<size_t>(layer) * num_local_ + local_index] = e;
}

event_handle step_layer_events::get(int64_t layer, size_t local_index) const {
  MOEBIUS_CHECK(layer >= 0 && layer < num_layers_ && local_index < num_local_, errc::out_of_range,
                "step_layer_events::get(", layer, ", ", local_index, "): ", num_layers_,
                " layers, ", num_local_, " local ranks");
  return events_[static_cast<size_t>(layer) * num_local_ + local_index];
}

progressive_switch::progressive_switch(detail::switch_state& owner,
                                       std::unique_ptr<detail::switch_transaction> txn,
                                       switch_report report)
    : owner_(&owner), txn_(std::move(txn)), report_(std::move(report)) {}

progressive_switch::progressive_switch(progressive_switch&& o) noexcept
    : owner_(o.owner_), txn_(std::move(o.txn_)), report_(std::move(o.report_)) {}

progressive_switch& progressive_switch::operator=(progressive_switch&& o) noexcept {
  if (this != &o) {
    if (open()) {
      try {
        abort();
      } catch (...) {  // the report says what happened; a move must not throw
      }
    }
    owner_ = o.owner_;
    txn_ = std::move(o.txn_);
    report_ = std::move(o.report_);
  }
  return *this;
}

progressive_switch::~progressive_switch() {
  if (!open()) return;
  try {
    abort();
  } catch (...) {  // the switcher's last_report() says what happened
  }
}

const switch_report& progressive_switch::report() const {
  return txn_ ? txn_->report() : report_;
}

void progressive_switch::close() {
  report_ = txn_->report();
  owner_->last_report = report_;
  owner_->open = nullptr;
  // An inconsistent end stays with the switcher: recover() rebuilds from it.
  if (report_.outcome == switch_outcome::inconsistent) owner_->wreck = std::move(txn_);
  txn_.reset();
  notify_switch_observer(report_, switch_style::progressive);
}

int64_t progressive_switch::layers_remaining() const {
  return txn_ ? txn_->units_remaining() : 0;
}

const layer_bytes& progressive_switch::bytes_per_layer() const {
  MOEBIUS_CHECK(open(), errc::invalid_argument,
                "progressive_switch::bytes_per_layer: the switch is not open (",
                to_string(report_.outcome), ")");
  return txn_->bytes_per_layer();
}

switch_step_view progressive_switch::view() const {
  MOEBIUS_CHECK(open(), errc::invalid_argument,
                "progressive_switch::view: the switch is not open (", to_string(report_.outcome),
                ")");
  return txn_->view();
}

const layer_completion& progressive_switch::advance(int64_t layers,
                                                    std::span<const stream_handle> streams,
                                                    const step_layer_events* beside) {
  MOEBIUS_CHECK(open(), errc::invalid_argument, "advance: the progressive switch is not open (",
                to_string(report_.outcome), ")");
  MOEBIUS_CHECK(!txn_->outstanding(), errc::invalid_argument,
                "advance: the previous advance is still in flight; poll() until it is ready");
  MOEBIUS_CHECK(layers >= 1, errc::invalid_argument, "advance: layers must be >= 1 (got ",
                layers, ")");
  return txn_->enqueue(layers, streams, beside);
}

progress_state progressive_switch::poll() {
  if (!open()) return progress_state::ended;
  const progress_state s = txn_->poll();
  if (s == progress_state::ended) close();
  return s;
}

progress_state progressive_switch::wait() {
  if (!open()) return progress_state::ended;
  txn_->wait();
  return poll();  // nothing outstanding now: ready, or ended (and closed) on a failure
}

switch_report progressive_switch::finish() {
  if (!open()) return report_;
  txn_->finish();
  close();
  return report_;
}

switch_report progressive_switch::abort() {
  if (!open()) return report_;
  txn_->abort("aborted");
  close();
  return report_;
}

}  // namespace moebius
