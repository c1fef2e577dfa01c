// The runtime's environment variables, read in one place (gpu_runtime.hpp lists them).

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "gpu_runtime.hpp"

namespace mini_engine::gpu {

namespace {

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

}  // namespace

gpu_runtime_options options_from_env() {
  gpu_runtime_options o;
  if (const char* v = std::getenv("MINI_ENGINE_NO_GRAPHS"); v != nullptr && *v == '1')
    o.capture_graphs = false;
  if (env_is("MINI_ENGINE_HYBRID_EAGER", "1")) o.hybrid_graphs = false;
  o.profile = env_is("MINI_ENGINE_PROFILE", "1");
  o.simple_attention =
      env_is("MINI_ENGINE_SIMPLE_ATTENTION", "1") || env_is("MINI_ENGINE_ATTENTION", "simple");
  o.tensor_core_attention = !env_is("MINI_ENGINE_ATTENTION", "split");
  o.tensor_core_min_tokens = [] {
    if (env_is("MINI_ENGINE_ATTENTION", "mma")) return int64_t{1};
    const char* v = std::getenv("MINI_ENGINE_ATTENTION_MMA_MIN_TOKENS");
    return v != nullptr ? std::max<int64_t>(1, std::strtoll(v, nullptr, 10))
                        : gpu_runtime_options{}.tensor_core_min_tokens;
  }();
  o.attention_splits = [] {
    const char* v = std::getenv("MINI_ENGINE_ATTENTION_SPLITS");
    return v != nullptr ? std::max<int64_t>(0, std::strtoll(v, nullptr, 10)) : int64_t{0};
  }();
  o.moe_tile_scale = [] {
    const char* v = std::getenv("MINI_ENGINE_MOE_TILE_SCALE");
    const int64_t n = v != nullptr ? std::strtoll(v, nullptr, 10) : 1;
    return n >= 1 && n <= 64 && (n & (n - 1)) == 0 ? n : int64_t{1};
  }();
  if (env_is("MINI_ENGINE_VIRTUAL_RANKS", "1")) o.placement = rank_placement::virtual_ranks;
  if (env_is("MINI_ENGINE_VIRTUAL_RANKS", "0")) o.placement = rank_placement::one_per_device;
  return o;
}

}  // namespace mini_engine::gpu
