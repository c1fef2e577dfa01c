#include "support/catch.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"
#include <iostream>
TEST_CASE("smoke") {
  auto g = moebius::make_arena_geometry(moebius::qwen3_235b_a22b(), 8);
  std::cout << g << "\n";
  auto p = moebius::plan_weight_switch(g, {0}, {2});
  moebius::print(std::cout, p, false);
  auto t = moebius::traffic_of(p);
  std::cout << t.max_bytes_sent() << "\n";
}
