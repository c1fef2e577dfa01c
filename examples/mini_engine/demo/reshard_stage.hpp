#pragma once

// Stage 1 of the demo: a verified reshard, the model's experts EP -> TP -> EP through the
// switcher, with layout-independent checksums of every layer read back from the ranks before
// and after each switch (the switcher undoes a switch whose checksums differ).

#include "world.hpp"

namespace mini_engine::demo {

// Prints a line per switch (`verbose`), else one line for both; true when both committed with
// equal checksums.
bool verified_reshard(world& w, bool verbose);

}  // namespace mini_engine::demo
