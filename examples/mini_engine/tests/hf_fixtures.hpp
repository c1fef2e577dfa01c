#pragma once

// Where the checkpoints transformers wrote lie (tests/fixtures/hf, make_hf_fixtures.py), for
// the host and the GPU runtime's tests of them.

#include <cstdlib>
#include <filesystem>

namespace mini_engine::testing {

// The source tree's fixtures (MINI_ENGINE_HF_FIXTURES, set by the target that includes this),
// or the environment's MINI_ENGINE_HF_FIXTURES where the binary runs from another checkout (a
// carried build: scripts/run-carried sets it).
inline std::filesystem::path hf_fixtures_root() {
  const char* moved = std::getenv("MINI_ENGINE_HF_FIXTURES");
  return moved != nullptr ? std::filesystem::path(moved)
                          : std::filesystem::path(MINI_ENGINE_HF_FIXTURES);
}

}  // namespace mini_engine::testing
