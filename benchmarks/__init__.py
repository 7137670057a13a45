"""Benchmarks of the fused SAGE loss against its peers: one harness, long-format rows.

`python -m benchmarks.loss` (or `sage-bench loss`) measures time, peak memory and error
against float64 for every provider on the same inputs; see benchmarks/README.md.
"""
