"""The disk tier, the executor's side: block files (files.py) and the threads that write, read
and list them off the step path (store.py). The scheduler's accounting of what is on disk is
engine/kv/disk_index.py (it imports nothing of the worker).
"""
