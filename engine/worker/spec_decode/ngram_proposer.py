"""N-gram prompt lookup: propose the tokens that followed the sequence's own suffix before.

The proposer runs on the executor, which holds every sequence's tokens in its request table
(engine/worker/input_batch.py). Where the proposals go (design (b) of issue #29): they travel
back to the scheduler in `StepOutput.draft_token_ids`, and the scheduler schedules them in
the next step (`CachedRequest.spec_token_ids`), counting them in the step's token budget and
reserving their slots with ordinary `allocate_slots`. Why not let the executor keep them and
have the scheduler reserve k slots blindly: the scheduler owns blocks and the budget, and only
it knows how many proposals exist (none, on text that never repeats), so it reserves exactly
those and nothing for sequences without a match; the executor stays stateless about
proposals, so preemption, swap-in and a new scheduler need no extra protocol. The price is a
few ints a sequence each way on the wire (ids only), and that the scheduler cannot plan the
next step before this one's proposals arrive (see engine/sched/lookahead.py).

Lookup (vLLM's `ngram` method): among the suffixes of `prompt_lookup_max` down to
`prompt_lookup_min` tokens, the longest that occurs earlier in the sequence wins, its most
recent occurrence breaking ties, and the (up to) k tokens that followed it are proposed.
Vectorised with numpy: candidate ends are the earlier positions holding the last token, and
each candidate's match length is grown backwards over at most `prompt_lookup_max` columns.
"""

import numpy as np
from kvpager.engine.worker.input_batch import InputBatch, RequestState


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max, "n-gram sizes"
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_for(
        self, batch: InputBatch, num_spec_tokens: dict[str, int]
    ) -> dict[str, list[int]]:
        """Proposals for the sequences a step asked (seq id -> k), over their tokens so far in
        the executor's request table; a sequence without a match gets none."""
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
        num_tokens = len(token_ids)
        if k < 1 or num_tokens < self.min_n + 1:
            return []
        # a candidate occurrence ends at `end` < num_tokens - 1, so a token follows it
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        if ends.size == 0:
            return []
        match_len = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, self.max_n):
            if num_tokens - 1 - back < 0:
                break
            idx = ends - back
            same = (idx >= 0) & (token_ids[np.maximum(idx, 0)] == token_ids[-1 - back])
            alive &= same
            match_len += alive
            if not alive.any():
                break
        best = int(match_len.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(match_len == best)[-1]])  # the most recent
        return token_ids[end + 1 : end + 1 + k].tolist()

    def remove(self, batch: InputBatch, state: RequestState) -> None:
        """Nothing to keep: prompt lookup reads only the sequence's own tokens."""
