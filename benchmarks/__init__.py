"""Benchmark scripts (`python -m benchmarks.<name>`, run from the repository root) and the
plumbing they share: report headers and paths, options, a Serve session of their own, gRPC
calls, /proc accounting, paired statistics, and replicas with timing probes. Each benchmark
keeps one current report in `results/`; README.md has the current figures.

May import: everything.
"""
