"""Tensor parallelism's plumbing: the rank group and its collectives (group.py), rank 0's
link to the other ranks (ranks.py), starting them on this machine (spawn.py)."""
