"""Speculative decoding's bookkeeping in the scheduler: lookahead slots, rollback, self-tuning.

The executor proposes tokens after a step (engine/worker/spec_decode/ngram_proposer.py, which
says why the proposals travel back rather than staying there); the scheduler verifies them in
the next:

- **Lookahead slots.** A decoding request with d proposals is scheduled 1 + d tokens: its new
  token and the proposals, allocated by the ordinary `allocate_slots` (copy-on-write of a
  shared tail included, since the first of them lands where the new token would) and
  counted in the step's token budget. Only the proposals that fit the budget and
  `max_tokens` are scheduled.
- **Rollback.** The output says how many were accepted; the computed count rolls back past the
  rejected ones and the table drops blocks that only they had reached (`BlockManager.trim`),
  so a request holds exactly the blocks of its accepted tokens, as without speculation:
  preemption, swap and recompute see only accepted tokens. The prefix cache registers full
  blocks of *known* tokens only (the proposals are not in `all_token_ids`), so it never
  commits a rejected token.
- **Plan-ahead.** A step that verifies or asks for proposals is not followed by a planned one
  (`lockstep`): the next step depends on how many were accepted and on the new proposals. Once
  the batch outgrows `max_num_seqs_to_speculate`, speculation steps aside and plan-ahead
  resumes. Beams and structured outputs never speculate.
- **Self-tuning.** Each request's k starts at `num_speculative_tokens`, halves after a step
  with none accepted and doubles after one with all accepted, within [1, k].
- **Switching off.** Verifying costs compute in proportion to the tokens verified, and
  lockstep costs plan-ahead, which pays little at small batches on a CPU (decoding is bound
  by reading the weights, so a few more tokens a step are nearly free) and much at large
  ones. Two switches: above `max_num_seqs_to_speculate` running sequences nobody speculates
  (vLLM's `disable_by_batch_size`); and a request whose last `ACCEPTANCE_WINDOW` verified
  proposals were accepted at under `min_acceptance_rate` is asked for none for its next
  `PAUSE_TOKENS` tokens, then tries again with a fresh window. With every request paused or
  the batch too large, no step asks for proposals, so plan-ahead resumes.
"""

from dataclasses import dataclass, field

from kvpager.engine.config import SpeculativeConfig
from kvpager.engine.kv.block_manager import BlockManager
from kvpager.engine.request import Request

ACCEPTANCE_WINDOW = 32  # verified proposals judged at once, per request
PAUSE_TOKENS = 64  # output tokens a request under the acceptance rate goes without proposals


@dataclass
class SpecDecodeStats:
    """vLLM's counters: acceptance rate = accepted / draft tokens; mean accepted length per
    draft = 1 + accepted / drafts (the model's own token counted)."""

    num_drafts: int = 0  # sequences whose proposals a step verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_pauses: int = 0  # times a request's acceptance rate switched it off (not exported)


@dataclass
class Lookahead:
    config: SpeculativeConfig | None
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    lockstep: bool = False  # the last step verified or asked for proposals
    _k_of: dict[str, int] = field(default_factory=dict)  # seq id -> its current k
    _verified: dict[int, dict[str, int]] = field(default_factory=dict)  # step -> seq -> d
    _window: dict[str, tuple[int, int]] = field(default_factory=dict)  # seq -> (drafts, accepted)
    _paused_until: dict[str, int] = field(default_factory=dict)  # seq -> its output length

    def is_on(self, num_running: int) -> bool:
        config = self.config
        return config is not None and num_running <= config.max_num_seqs_to_speculate

    def drafts_to_verify(self, request: Request, num_new: int, budget: int, num_running: int):
        """The proposals to compute after the request's one new token in this step."""
        drafts = request.spec_token_ids
        if not drafts or num_new != 1 or request.num_output_placeholders:
            return []
        if not self.is_on(num_running) or self._paused(request):
            return []
        room = request.sampling_params.max_tokens - request.num_output_tokens - 1
        return drafts[: max(0, min(budget - 1, room, self._k(request)))]

    def asks(self, sampling: list[Request], num_running: int) -> dict[str, int]:
        """Sampling requests of this step -> how many proposals the executor makes after it."""
        if not self.is_on(num_running):
            return {}
        asks = {}
        for request in sampling:
            params = request.sampling_params
            num_left = params.max_tokens - request.num_output_tokens
            num_left -= request.num_output_placeholders + 1  # the tokens these steps sample
            # structured outputs are not speculated: a proposal would have to pass the grammar
            # and its matcher roll back on rejection (the simplest correct choice)
            speculable = not params.is_beam_search and params.structured_outputs is None
            speculable &= not self._paused(request)
            if speculable and num_left > 0:
                asks[request.seq_id] = min(self._k(request), num_left)
        return asks

    def planned(self, step_id: int, verified: dict[str, int], asks: dict[str, int]) -> None:
        if verified:
            self._verified[step_id] = verified
        self.lockstep = bool(verified or asks)

    def roll_back(
        self, step_id: int, request: Request, num_emitted: int, manager: BlockManager
    ) -> None:
        """A step's output for a request: un-compute its rejected proposals, tune its k."""
        num_drafts = self._verified.get(step_id, {}).pop(request.seq_id, 0)
        if not num_drafts:
            return
        num_accepted = num_emitted - 1
        assert 0 <= num_accepted <= num_drafts, f"{request.seq_id}: {num_accepted} accepted"
        request.num_computed_tokens -= num_drafts - num_accepted
        manager.trim(request, request.num_computed_tokens)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        self._judge_acceptance(request, num_drafts, num_accepted)
        k = self._k(request)
        if num_accepted == 0:
            self._k_of[request.seq_id] = max(1, k // 2)
        elif num_accepted == num_drafts:
            self._k_of[request.seq_id] = min(self.config.num_speculative_tokens, 2 * k)

    def _judge_acceptance(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        drafts, accepted = self._window.get(request.seq_id, (0, 0))
        drafts, accepted = drafts + num_drafts, accepted + num_accepted
        if drafts < ACCEPTANCE_WINDOW:
            self._window[request.seq_id] = (drafts, accepted)
            return
        del self._window[request.seq_id]
        if accepted < self.config.min_acceptance_rate * drafts:
            # the step's tokens (accepted + the model's own) are appended after this
            num_after = request.num_output_tokens + num_accepted + 1
            self._paused_until[request.seq_id] = num_after + PAUSE_TOKENS
            self.stats.num_pauses += 1

    def take_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """The executor's new proposals; dropped if a step already planned will move past
        the position they start at."""
        request.spec_token_ids = list(drafts or ()) if not request.num_output_placeholders else []

    def end_step(self, step_id: int) -> None:
        for old in [s for s in self._verified if s <= step_id]:
            del self._verified[old]

    def forget(self, seq_id: str) -> None:
        self._k_of.pop(seq_id, None)
        self._window.pop(seq_id, None)
        self._paused_until.pop(seq_id, None)

    def _paused(self, request: Request) -> bool:
        return request.num_output_tokens < self._paused_until.get(request.seq_id, 0)

    def _k(self, request: Request) -> int:
        assert self.config is not None, "speculation is off"
        return self._k_of.get(request.seq_id, self.config.num_speculative_tokens)
