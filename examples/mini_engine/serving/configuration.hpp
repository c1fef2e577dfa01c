#pragma once

// A serving configuration: the parallel layout a step runs in (attention and experts, each EP or
// TP: moebius::parallel_layout) and, for TP attention, its decode context parallel degree (the
// ranks sharing a KV head split its tokens: kv_geometry::dcp). What a deployment serves in, what
// a step is priced as, and what the step curves are keyed by.
//
//   name        layout                       dcp   what the engines call it
//   "TP"        {tp, tp}                     1     TP
//   "TP-DCP2"   {tp, tp}                     2     TP with vLLM's -dcp 2
//   "EP"        {ep, ep}                     1     data-parallel attention, EP experts
//   "TEP"       {tp attention, ep experts}   1     vLLM's --enable-expert-parallel, TRT-LLM TEP
//   "TEP-DCP2"  {tp attention, ep experts}   2     the same with -dcp 2
//
// dcp applies to TP attention only (data-parallel attention holds each sequence whole on one
// rank). {data-parallel attention, TP experts} has no name here: no deployment serves in it.

#include <cstdint>
#include <string>
#include <string_view>

#include <moebius/layout/parallel_layout.hpp>

namespace mini_engine {

struct configuration {
  moebius::parallel_layout layout;
  int64_t dcp = 1;  // decode context parallel degree of TP attention; 1 under EP attention

  constexpr configuration() = default;
  constexpr configuration(moebius::parallel_layout l, int64_t d = 1) : layout(l), dcp(d) {}
  // A mode's uniform layout without dcp ("TP", "EP"): the paper's two configurations.
  constexpr configuration(moebius::parallel_mode m) : layout(m) {}  // NOLINT

  moebius::parallel_mode attention() const { return layout.attention; }
  moebius::parallel_mode experts() const { return layout.experts; }
  friend constexpr bool operator==(const configuration&, const configuration&) = default;
};

// Named configurations of the paper's deployment (Qwen3-235B-A22B at P = 8: dcp 2 at most).
inline constexpr configuration k_tp{moebius::parallel_mode::tp};
inline constexpr configuration k_ep{moebius::parallel_mode::ep};
inline constexpr configuration k_tep{{moebius::parallel_mode::tp, moebius::parallel_mode::ep}};
inline constexpr configuration k_tp_dcp2{moebius::parallel_mode::tp, 2};
inline constexpr configuration k_tep_dcp2{{moebius::parallel_mode::tp, moebius::parallel_mode::ep},
                                          2};

// "TP", "EP", "TEP", "TP-DCP2", "TEP-DCP4", ... (dcp omitted when 1); a configuration with no
// name (data-parallel attention with TP experts, or dcp under data-parallel attention) as
// "DP attention, TP experts" or "EP-DCP2?" (printable, never parsed).
std::string name_of(const configuration& c);

// The inverse of name_of, case-insensitive ("tep-dcp2", "TP-dcp2" as the rank-share bench
// writes it): TP, EP or TEP, then optionally "-DCP<d>" with d >= 1 (TP and TEP only). Throws
// moebius::error(errc::invalid_argument) naming the text and the accepted forms.
configuration parse_configuration(std::string_view name);

// The layout each of the switch policy's two modes serves in. The policy proposes EP for a large
// load and TP for a small one; a deployment maps them onto its layouts: the paper's EP and TP
// (the default), experts only's {tp attention, ep experts} and TP, dcp only's TP at dcp 2 and
// TP at dcp 1. A step's configuration is its layout with the KV's dcp under TP attention
// (configuration_of): the KV geometry's, unless the mode names its own (ep_dcp, tp_dcp: a
// design whose two modes differ in the TP view's dcp alone, the layout the same).
struct mode_layouts {
  moebius::parallel_layout ep = moebius::parallel_mode::ep;
  moebius::parallel_layout tp = moebius::parallel_mode::tp;
  // The TP view's dcp each mode serves at under TP attention; 0: the KV geometry's (as the
  // engine was built; every design but dcp only). engine::run refuses a dcp named for one mode
  // alone, or for modes that differ in their layout.
  int64_t ep_dcp = 0, tp_dcp = 0;

  moebius::parallel_layout of(moebius::parallel_mode m) const {
    return m == moebius::parallel_mode::ep ? ep : tp;
  }
  // The dcp mode `m` serves at when the KV is at `kv_dcp` now: its own, else kv_dcp (also
  // under data-parallel attention, where the dcp does not apply and a switch keeps it).
  int64_t dcp_of(moebius::parallel_mode m, int64_t kv_dcp) const {
    const int64_t d = m == moebius::parallel_mode::ep ? ep_dcp : tp_dcp;
    return of(m).attention == moebius::parallel_mode::tp && d > 0 ? d : kv_dcp;
  }
  // Whether the two modes differ in the KV's dcp alone (dcp only: a switch plans a dcp change):
  // one TP-attention layout, each mode's dcp named and different.
  bool differ_in_dcp_alone() const {
    return ep == tp && ep.attention == moebius::parallel_mode::tp && ep_dcp > 0 && tp_dcp > 0 &&
           ep_dcp != tp_dcp;
  }
  // The mode whose layout `l` is, at the KV's dcp `kv_dcp` when the two modes share a layout;
  // a layout neither mode names (the switcher's before a run moves it to its start): the mode
  // of its experts.
  moebius::parallel_mode mode_of(moebius::parallel_layout l, int64_t kv_dcp) const {
    if (differ_in_dcp_alone() && l == ep)
      return kv_dcp == ep_dcp ? moebius::parallel_mode::ep : moebius::parallel_mode::tp;
    if (l == ep) return moebius::parallel_mode::ep;
    if (l == tp) return moebius::parallel_mode::tp;
    return l.experts;
  }
  friend constexpr bool operator==(const mode_layouts&, const mode_layouts&) = default;
};

// The configuration a step in layout `l` runs in over a KV pool of decode context parallel
// degree `dcp`: dcp under TP attention, 1 under data-parallel attention.
constexpr configuration configuration_of(moebius::parallel_layout l, int64_t dcp) {
  return configuration{l, l.attention == moebius::parallel_mode::tp ? dcp : 1};
}

// Whether `c` is one of the named forms: attention TP, or attention and experts EP with dcp 1;
// dcp >= 1.
bool is_named(const configuration& c);

}  // namespace mini_engine
