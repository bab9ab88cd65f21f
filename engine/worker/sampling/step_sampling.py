"""A step's sampling on the executor: every sampled row (one a sequence, plus one per proposal
it verifies), through the sampler with its grammar masks, then the accepted tokens appended to
the request table and the matchers, and the step's output with their logprobs.
"""

import torch
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.worker.grammar_rows import GrammarRows
from kvpager.engine.worker.input_batch import InputBatch
from kvpager.engine.worker.sampling.batch import SamplingBatch
from kvpager.engine.worker.sampling.sampler import Sampler, SamplerOutput
from kvpager.engine.worker.spec_decode.rejection import accept_sampled_drafts
from kvpager.engine.worker.spec_decode.verify import VerifyRows, accept, step_output
from kvpager.schemas.scheduler import StepOutput, TokenLogprobs


class StepSampler:
    """Samples a step's rows; the request table (`batch`) comes with each call, since the
    executor replaces it on reset while the sampler and the matchers stay."""

    def __init__(
        self,
        sampler: Sampler,
        grammars: GrammarRows,
        model_config: ModelConfig,
        device: torch.device,
    ) -> None:
        self.sampler = sampler
        self.grammars = grammars
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.device = device

    def sample(
        self, step_id: int, batch: InputBatch, states, logits, draft_logits=None
    ) -> StepOutput:
        """Sample every row (one a state, plus one per proposal), accept, append."""
        if not states:
            return StepOutput(step_id=step_id)
        with_prompts = any(s.params.repetition_penalty != 1.0 for s in states)
        rows = VerifyRows.build(states, batch, with_prompts)
        sampling = self._sampling_batch(states, rows)
        sampling.keep_probs = any(s.draft_probs is not None and s.draft_token_ids for s in states)
        sampled = self.sampler(rows.gather(logits, draft_logits), sampling)
        sampled_ids = sampled.sampled_token_ids.tolist()
        emitted = accept(states, rows, sampled_ids)
        if sampled.probs is not None:  # a draft model's sampled proposals: their q decides
            emitted = accept_sampled_drafts(
                states, rows, sampled_ids, sampled.probs, emitted, self.sampler.generator
            )
        for state, token_ids in zip(states, emitted):
            batch.accept(state, token_ids)
            self.grammars.accept(state, token_ids)
        return step_output(step_id, states, rows, emitted, _logprobs(sampled, rows.params))

    def _sampling_batch(self, states, rows: VerifyRows) -> SamplingBatch:
        sampling = SamplingBatch.build(
            params=rows.params,
            seed_positions=rows.seed_positions,
            prompt_token_ids=rows.prompt_token_ids,
            output_token_ids=rows.output_token_ids,
            eos_token_ids=list(self.eos_token_ids),
            vocab_size=self.vocab_size,
            device=self.device,
        )
        if self.grammars.matchers:
            masks = self.grammars.bitmask(states, rows.offsets, self.device)
            if masks is not None:
                sampling.bitmask_rows, sampling.bitmask = masks
        return sampling


def _logprobs(sampled: SamplerOutput, params) -> list[TokenLogprobs] | None:
    if sampled.logprobs is None:
        return None
    values = sampled.logprobs.tolist()
    top_ids = sampled.top_logprob_ids.tolist() if sampled.top_logprob_ids is not None else None
    top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    out = []
    for i, row_params in enumerate(params):
        k = row_params.logprobs or 0
        out.append(
            TokenLogprobs(
                logprob=values[i],
                top_token_ids=top_ids[i][:k] if top_ids else [],
                top_logprobs=top_values[i][:k] if top_values else [],
            )
        )
    return out
