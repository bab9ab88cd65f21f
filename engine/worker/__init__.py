"""The worker: the executor (weights, paged cache tensors, one step's forward and sampling),
its request table, the sampler, the in-process step runner, tensor parallelism, step checks.
"""
