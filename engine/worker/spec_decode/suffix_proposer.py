"""Suffix decoding (vLLM's `suffix` method, from Snowflake's Arctic Inference): propose the
most frequent continuation of the longest matching suffix, in the sequence or across requests.

Two sources, as Arctic's SuffixDecodingCache has (a per-request prompt tree and a global
response tree): the sequence's own tokens (prompt and output so far, read in place from the
executor's request table) and the outputs of the last `suffix_decoding_max_cached_requests`
requests (suffix_cache.py, filled as rows leave the request table). Each gives its best draft
(suffix_match.py: the match of up to `suffix_decoding_max_tree_depth` tokens, a walk that
stops once the path's estimated probability falls under `suffix_decoding_min_token_prob`,
at most `suffix_decoding_max_spec_factor` x the match length tokens and at most the k the
scheduler asked); the higher score (the sum of the tokens' probabilities) is proposed. The
length adapts: a long, frequent match proposes many tokens, a short or ambiguous one few or
none, so text that never repeats costs a scan and proposes nothing.

Proposals travel like the n-gram proposer's (ngram_proposer.py says how and why) and are
verified the same way (verify.py): greedy outputs and seeded samples are unchanged.
"""

import numpy as np
from kvpager.engine.config import SpeculativeConfig
from kvpager.engine.worker.input_batch import InputBatch, RequestState
from kvpager.engine.worker.spec_decode.suffix_cache import SuffixCache
from kvpager.engine.worker.spec_decode.suffix_match import DraftLimits, best_draft


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.cache = SuffixCache(config.suffix_decoding_max_cached_requests)

    def propose_for(
        self, batch: InputBatch, num_spec_tokens: dict[str, int]
    ) -> dict[str, list[int]]:
        """Proposals for the sequences a step asked (seq id -> k); none without a match."""
        drafts = {}
        for seq_id, k in num_spec_tokens.items():
            state = batch.states.get(seq_id)
            if state is not None:
                tokens = batch.token_ids[state.row, : state.num_tokens]
                if proposal := self.propose(tokens, k):
                    drafts[seq_id] = proposal
        return drafts

    def propose(self, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids` (int64 [num_tokens]); [] without a match."""
        if k < 1 or not len(token_ids):
            return []
        limits = DraftLimits(k, self.max_depth, self.max_spec_factor, self.min_token_prob)
        context = token_ids[-self.max_depth :]
        own = best_draft(token_ids, context, limits)
        ends = self.cache.ends_of(int(context[-1]))
        cached = best_draft(self.cache.tokens(), context, limits, ends)
        if cached.score > own.score:
            self.cache.touch(cached.ends)
            return cached.token_ids
        return own.token_ids

    def remove(self, batch: InputBatch, state: RequestState) -> None:
        """A row leaves the request table (finished, aborted or preempted): keep its output."""
        output = batch.token_ids[state.row, state.num_prompt_tokens : state.num_tokens]
        self.cache.add(state.seq_id, output)
