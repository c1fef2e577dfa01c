// Recovery after a switch that left the switcher inconsistent: in a run (the switch's source
// mode, the lost sequences handed to the scheduler) or after one (engine.hpp).
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>

#include "engine_run_state.hpp"
#include "kv_pages.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_state;
using moebius::parallel_mode;

void engine::recover_in_run(run_state& st, const moebius::switch_report& r, switch_record& s) {
  MOEBIUS_CHECK(static_cast<bool>(st.options.reload_experts), errc::internal, "engine::run '",
                st.name, "': the switch left the engine inconsistent: ", r.error,
                " (set engine_options::reload_experts to recover without a restart, or call "
                "engine::recover)");
  moebius::recovery_request q;
  q.layout = s.from;
  q.reload_experts = st.options.reload_experts;
  const moebius::recovery_report rr = switcher_.recover(q);
  follow_kv_dcp();
  MOEBIUS_CHECK(rr.recovered, errc::internal, "engine::run '", st.name,
                "': recovery after an inconsistent switch failed: ", rr.error, " (after: ", r.error,
                ")");
  s.recovered = true;
  s.lost_sequences = st.sched.lose_kv(
      switcher_.mutable_kv_tables(), rr.lost, st.options.lost_kv == lost_kv_policy::resume,
      "its KV cache was lost when a switch failed (" + r.error + ")");
}

moebius::recovery_report engine::recover(
    const std::function<void(moebius::arena_cursor)>& reload_experts, parallel_mode mode) {
  moebius::recovery_request q;
  q.layout = mode;
  q.reload_experts = reload_experts;
  const moebius::recovery_report rr = switcher_.recover(q);
  follow_kv_dcp();
  MOEBIUS_CHECK(rr.recovered, errc::internal, "engine::recover: ", rr.error);
  release_all_sequences(switcher_.mutable_kv_tables());  // no run to resume what was kept
  return rr;
}

}  // namespace mini_engine
