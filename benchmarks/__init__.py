"""Benchmarks: load generator, systems under test, offline limit, perf_analyzer cross-check, report.

`python -m benchmarks.run [--quick]` runs everything and regenerates docs/benchmarks.md.
"""
