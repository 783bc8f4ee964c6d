"""The performance suite (results in docs/benchmarks.md)."""
