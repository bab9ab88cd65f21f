"""The scheduler: continuous batching under one rule (scheduler.py, with its admission,
preemption and output-update parts beside it), step plans, request checks, beam search
bookkeeping, speculation's lookahead, the deltas and metrics it emits. Pure Python: no torch,
no worker.
"""
