"""KV memory accounting: the block manager (ref counts, prefix cache, copy-on-write, swap),
block hashes, the CPU pool, and KV sizing. The home of further tiers and layouts.
"""
