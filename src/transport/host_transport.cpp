#include "moebius/transport/host_transport.hpp"

#include <cstring>
#include <utility>

namespace moebius {

namespace {

// The rank count once validate_rank_memory accepts `ranks` (its message, not the base's, for
// an empty list).
int validated_rank_count(const std::vector<rank_memory>& ranks) {
  validate_rank_memory(ranks, memory_kind_rule::require_host);
  return static_cast<int>(ranks.size());
}

}  // namespace

host_transport::host_transport(std::vector<rank_memory> ranks)
    : synchronous_transport(validated_rank_count(ranks), "host_transport",
                            "host memory has no streams"),
      ranks_(std::move(ranks)) {}

void host_transport::validate(const plan& p) const {
  validate_plan_fits(p, num_ranks(), ranks_);
}

void host_transport::run_ops(const plan_phase& phase, size_t num_ops) {
  for (size_t i = 0; i < num_ops; ++i) {
    const copy_op& op = phase.ops[i];
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
