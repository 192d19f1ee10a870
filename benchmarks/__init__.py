"""Benchmark scripts, one per question (`python -m benchmarks.<name>`, run from the repository
root), and the plumbing they share: options and report header, /proc accounting, a Serve
session of their own, a load client. Each keeps one current report in `results/`; README.md
has the current figures.

May import: everything.
"""
