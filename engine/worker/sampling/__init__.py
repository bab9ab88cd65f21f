"""Sampling, the executor's side: a step's parameters as tensors (batch.py), one token a row
from its logits (sampler.py; top_k_top_p.py its filters), and a step's sampling on the
executor: its rows, verified proposals and grammar masks (step_sampling.py)."""
