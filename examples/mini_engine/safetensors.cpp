// Filled in by item 3.
