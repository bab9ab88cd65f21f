"""The worker: the executor (weights, paged cache tensors, one step's forward and sampling),
its cache tensors, request table and sampler, the in-process step runner, tensor parallelism,
step checks; speculative decoding (spec_decode/) and the disk tier (disk/) in rooms of their own.
"""
