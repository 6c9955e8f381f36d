"""Benchmark-only models: hand-written parallel implementations the benchmarks compare autoshard with."""
