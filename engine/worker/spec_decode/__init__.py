"""Speculative decoding, the executor's side: proposals by n-gram lookup (ngram_proposer.py),
suffix decoding (suffix_*.py) or a draft model sharing the paged cache (draft_model.py), and
their verification in the next step (verify.py; rejection.py for a draft's sampled
proposals). The scheduler's side, lookahead slots and rollback, is engine/sched/lookahead.py
(it imports nothing of the worker).
"""
