"""The scheduler: continuous batching under one rule, step plans, request checks, beam
search bookkeeping, the deltas and metrics it emits. Pure Python: no torch, no worker.
"""
