"""Benchmarks: serving throughput and latency against peers (run.py), kernels (kernels.py)."""
