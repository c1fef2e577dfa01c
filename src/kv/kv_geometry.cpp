#include "moebius/kv/kv_geometry.hpp"

#include <ostream>

#include "moebius/detail/checked_math.hpp"
#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

// The dcp rules of kv_geometry.hpp, once the heads are known to divide: the ranks splitting a
// head slice's tokens must be ranks that hold that slice, in whole sets.
void validate_dcp(const kv_geometry& g) {
  MOEBIUS_CHECK(g.dcp >= 1, errc::invalid_argument,
                "kv_geometry needs dcp >= 1, 1 meaning every TP rank holds every token of its "
                "heads (dcp=", g.dcp, ")");
  if (g.latent()) {
    MOEBIUS_CHECK(g.dcp <= g.num_ranks && g.num_ranks % g.dcp == 0, errc::invalid_argument,
                  "dcp must divide P for a latent KV cache (TP replicates it on every rank; "
                  "dcp=", g.dcp, ", P=", g.num_ranks, ")");
  } else if (g.num_kv_heads >= g.num_ranks) {
    MOEBIUS_CHECK(g.dcp == 1, errc::invalid_argument,
                  "dcp must be 1 when H_kv >= P: no two TP ranks hold the same head, so none can "
                  "split its tokens (dcp=", g.dcp, ", H_kv=", g.num_kv_heads, ", P=",
                  g.num_ranks, ")");
  } else {
    MOEBIUS_CHECK(g.tp_replicas() % g.dcp == 0, errc::invalid_argument,
                  "dcp must divide tp_replicas() = P/H_kv, the TP ranks holding one head (dcp=",
                  g.dcp, ", P/H_kv=", g.tp_replicas(), ", H_kv=", g.num_kv_heads, ", P=",
                  g.num_ranks, ")");
  }
}

}  // namespace

void validate(const kv_geometry& g) {
  MOEBIUS_CHECK(g.num_layers >= 1, errc::invalid_argument,
                "kv_geometry needs num_layers >= 1 (num_layers=", g.num_layers, ")");
  MOEBIUS_CHECK(g.num_kv_heads >= 0, errc::invalid_argument,
                "kv_geometry needs num_kv_heads >= 0, 0 meaning latent (num_kv_heads=",
                g.num_kv_heads, ")");
  MOEBIUS_CHECK(g.head_dim >= 1, errc::invalid_argument,
                "kv_geometry needs head_dim >= 1 (head_dim=", g.head_dim, ")");
  MOEBIUS_CHECK(g.page_size >= 1, errc::invalid_argument,
                "kv_geometry needs page_size >= 1 (page_size=", g.page_size, ")");
  MOEBIUS_CHECK(g.num_ep_pages >= 0, errc::invalid_argument,
                "kv_geometry needs num_ep_pages >= 0 (num_ep_pages=", g.num_ep_pages, ")");
  MOEBIUS_CHECK(g.num_ranks >= 1, errc::invalid_argument,
                "kv_geometry needs num_ranks >= 1 (num_ranks=", g.num_ranks, ")");
  detail::check_enum(g.type, "kv_geometry type (dtype)");
  detail::check_enum(g.layout, "kv_geometry layout (kv_layout)");
  if (!g.latent()) {
    if (g.num_kv_heads >= g.num_ranks) {
      MOEBIUS_CHECK(g.num_kv_heads % g.num_ranks == 0, errc::invalid_argument,
                    "P must divide H_kv when H_kv >= P (H_kv=", g.num_kv_heads,
                    ", P=", g.num_ranks, ")");
    } else {
      MOEBIUS_CHECK(g.num_ranks % g.num_kv_heads == 0, errc::invalid_argument,
                    "H_kv must divide P when H_kv < P, so each head is replicated on P/H_kv "
                    "ranks (H_kv=", g.num_kv_heads, ", P=", g.num_ranks, ")");
    }
  }
  validate_dcp(g);
  const int64_t page = detail::checked_product("KV page bytes", g.page_size, g.heads_per_ep_page(),
                                               g.head_dim, dtype_bytes(g.type));
  // num_tensors() = L x (K|V) is unchecked: check it before any product uses it.
  const int64_t tensors = detail::checked_mul(g.num_layers, g.kv_tensors(), "KV tensors (L x K|V)");
  // One page over every tensor (a staging slot, page_bytes_all_tensors) must fit even when
  // the pool has no pages and its own product is 0.
  detail::checked_mul(page, tensors, "KV page bytes over all tensors");
  detail::checked_product("KV pool bytes", page, g.num_ep_pages, tensors);
  detail::checked_mul(g.num_ep_pages, g.tp_pages_per_ep_page(), "TP page count");
}

kv_geometry make_kv_geometry(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim,
                             int64_t page_size, int64_t num_ep_pages, int num_ranks, dtype type,
                             kv_layout layout) {
  kv_geometry g;
  g.num_layers = num_layers;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.page_size = page_size;
  g.num_ep_pages = num_ep_pages;
  g.num_ranks = num_ranks;
  g.type = type;
  g.layout = layout;
  validate(g);
  return g;
}

kv_geometry with_dcp(kv_geometry g, int64_t dcp) {
  g.dcp = dcp;
  validate(g);
  return g;
}

int64_t ep_pages_for_bytes(const kv_geometry& g, int64_t pool_bytes) {
  kv_geometry one = g;
  one.num_ep_pages = 1;
  validate(one);
  MOEBIUS_CHECK(pool_bytes >= 0, errc::invalid_argument, "pool_bytes must be >= 0 (pool_bytes=",
                pool_bytes, ")");
  return pool_bytes / one.pool_bytes();
}

std::ostream& operator<<(std::ostream& os, const kv_geometry& g) {
  os << "kv_geometry{L=" << g.num_layers << ", H_kv=";
  if (g.latent()) os << "latent";
  else os << g.num_kv_heads;
  os << ", D=" << g.head_dim << ", page_size=" << g.page_size
            << ", ep_pages=" << g.num_ep_pages << ", tp_pages=" << g.num_tp_pages()
            << ", P=" << g.num_ranks << ", " << to_string(g.type) << ", "
            << to_string(g.layout);
  // dcp = 1 prints as before: printed plans and logs of today's deployments do not change.
  if (g.dcp != 1) os << ", dcp=" << g.dcp;
  return os << ", pool_bytes=" << g.pool_bytes() << '}';
}

}  // namespace moebius
