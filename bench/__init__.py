"""Benchmarks: trace replay, load generation and reports (results in bench/RESULTS.md)."""
