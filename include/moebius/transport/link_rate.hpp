#pragma once

// A data rate, in bytes per second: what a link (NVLink, a copy engine, HBM) moves per GPU
// per direction. One type in one unit for every rate Moebius takes (the cost model's link,
// the progressive switch's pacing, an engine's hardware model), so that no caller has to know
// which struct wants GB/s and which B/s. GB are decimal (1e9 bytes), as link rates are quoted.
//
//   link_rate nvlink = link_rate::gb_per_s(389);   // nvlink.bytes_per_s == 389e9
//   nvlink.gb_per_s()                              // 389
//   link_rate{330e9} == link_rate::gb_per_s(330)   // true

namespace moebius {

struct link_rate {
  double bytes_per_s = 0;  // bytes per second (0: no rate given)

  static constexpr link_rate gb_per_s(double gb) { return link_rate{gb * 1e9}; }
  constexpr double gb_per_s() const { return bytes_per_s / 1e9; }

  friend constexpr bool operator==(const link_rate&, const link_rate&) = default;
};

}  // namespace moebius
