"""Speculative decoding, the executor's side: n-gram proposals over each sequence's own tokens
(ngram_proposer.py) and their verification in the next step (verify.py). The scheduler's side,
lookahead slots and rollback, is engine/sched/lookahead.py (it imports nothing of the worker).
"""
