"""KV memory accounting: the block pool (free queue, ref counts, prefix cache by hash), the
block managers over it (block tables, copy-on-write, swap, sliding windows, KV groups), prefix
hits by attention type, block hashes, the CPU pool, the disk tier's index, and KV sizing. The
home of further tiers and layouts.
"""
