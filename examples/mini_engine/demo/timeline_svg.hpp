#pragma once

// An SVG timeline of serving runs, written directly (no plotting dependency): per run a
// panel with the mode as background bands (TP / EP), the batch (sequences per step) as a
// line, the step time as a second line on its own axis (each line at most its range per half
// pixel), and a mark at each switch.

#include <iosfwd>
#include <vector>

#include "engine.hpp"

namespace mini_engine::demo {

void write_timeline_svg(std::ostream& os, const std::vector<const run_result*>& runs);

}  // namespace mini_engine::demo
