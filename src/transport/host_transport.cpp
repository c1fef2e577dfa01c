#include "moebius/transport/host_transport.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

#include "moebius/error.hpp"

namespace moebius {

host_transport::host_transport(std::vector<host_rank_memory> ranks) : ranks_(std::move(ranks)) {
  MOEBIUS_CHECK(!ranks_.empty(), errc::invalid_argument, "host_transport needs at least one rank");
  // Spans of different ranks (and spaces) must not alias: a copy between two ranks would
  // otherwise overwrite its own source.
  std::vector<std::pair<const std::byte*, const std::byte*>> extents;
  for (const host_rank_memory& r : ranks_) {
    for (const std::span<std::byte>& s : r.spaces) {
      if (!s.empty()) extents.emplace_back(s.data(), s.data() + s.size());
    }
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) {
    MOEBIUS_CHECK(extents[i - 1].second <= extents[i].first, errc::invalid_argument,
                  "host_transport rank memories overlap");
  }
}

void host_transport::validate(const plan& p) const {
  MOEBIUS_CHECK(p.num_ranks == num_ranks(), errc::invalid_argument, "plan is for ", p.num_ranks,
                " ranks but the transport has ", num_ranks());
  // Every rank must hold every op's range: use the smallest rank per space.
  int64_t caps[num_memory_spaces];
  for (int s = 0; s < num_memory_spaces; ++s) {
    caps[s] = static_cast<int64_t>(ranks_[0].spaces[s].size());
    for (const host_rank_memory& r : ranks_) {
      caps[s] = std::min(caps[s], static_cast<int64_t>(r.spaces[s].size()));
    }
  }
  moebius::validate(p, caps);
}

void host_transport::execute(const plan& p) {
  // An armed fault applies to this execute() only, reached or not.
  const std::optional<fault_point> fault = std::exchange(fault_, std::nullopt);
  completed_phases_ = 0;
  validate(p);
  for (int64_t k = 0; k < static_cast<int64_t>(p.phases.size()); ++k) {
    execute_phase(p, k, fault);
    completed_phases_ = k + 1;
  }
}

void host_transport::execute_phase(const plan& p, int64_t phase_idx,
                                   const std::optional<fault_point>& fault) {
  const std::vector<copy_op>& ops = p.phases[static_cast<size_t>(phase_idx)].ops;
  for (int64_t i = 0; i < static_cast<int64_t>(ops.size()); ++i) {
    if (fault && fault->phase == phase_idx && fault->op == i) {
      MOEBIUS_FAIL(errc::injected_fault, "injected fault before op ", i, " of phase ", phase_idx,
                   " ('", p.phases[static_cast<size_t>(phase_idx)].label, "')");
    }
    const copy_op& op = ops[static_cast<size_t>(i)];
    const std::byte* src =
        ranks_[static_cast<size_t>(op.src_rank)].space(op.src_space).data() + op.src_offset;
    std::byte* dst =
        ranks_[static_cast<size_t>(op.dst_rank)].space(op.dst_space).data() + op.dst_offset;
    for (int64_t row = 0; row < op.rows; ++row) {
      std::memcpy(dst + row * op.dst_pitch, src + row * op.src_pitch,
                  static_cast<size_t>(op.row_bytes));
    }
  }
}

}  // namespace moebius
