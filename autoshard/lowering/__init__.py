"""Lowering: what a rank runs, built from the compiled graph after the passes decided everything (one rank's
GraphModule with its shards and local shapes, its pipeline stages, context-parallel attention, recomputed
regions). Between `autoshard.passes` (deciding) and `autoshard.runtime` (running)."""
