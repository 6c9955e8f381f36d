"""Benchmarks: scripts that measure and write result tables (never timed tests). `python -m benchmarks`."""
