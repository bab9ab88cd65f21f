"""Sampler: one step's logits to one token a row, vectorised over the batch.

Order (vLLM's): grammar bitmask -> min_tokens -> logit_bias -> penalties -> [greedy rows: argmax] ->
temperature -> min_p -> top_k -> top_p -> sample. Sampling is by inverse CDF: one uniform
draw a row, looked up in the row's cumulative probabilities (on CPU by the C draw,
kernels/cpu_sampling.py, which sums the row's mass in blocks and walks only u's block). A
seeded row draws it from a generator seeded by (seed, output position) alone, so a seeded
request samples the same tokens whatever else shares its batch, and a request re-sent
elsewhere with its outputs so far (a migrated stream) goes on drawing exactly what it would
have drawn: no generator state has to outlive a process.
"""

from dataclasses import dataclass

import torch
from kvpager.engine.worker.sampling.batch import PenaltyTensors, SamplingBatch
from kvpager.engine.worker.sampling.top_k_top_p import top_k_top_p
from kvpager.kernels import cpu_sampling
from kvpager.kernels.bitmask import apply_token_bitmask


@dataclass
class SamplerOutput:
    """One token a row, and its logprobs when any row asked for them."""

    sampled_token_ids: torch.Tensor  # int64 [num_rows]
    logprobs: torch.Tensor | None  # float32 [num_rows]: log-prob of the sampled token
    top_logprob_ids: torch.Tensor | None  # int64 [num_rows, max_num_logprobs], best first
    top_logprobs: torch.Tensor | None  # float32 [num_rows, max_num_logprobs]
    # float32 [num_rows, vocab]: the distribution each random row drew from (meaningless on
    # greedy rows), with `keep_probs` only
    probs: torch.Tensor | None = None


class Sampler:
    """Samples one token a row from float logits [num_rows, vocab].

    Logprobs are the log_softmax of the logits after min_tokens bans and penalties but before
    temperature and top-k/top-p/min-p filtering (so they do not depend on the sampling knobs).
    Greedy rows are exactly `argmax` of the penalised logits (ties: lowest index).
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for rows without a seed of their own; None: torch's global

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # the edits below are in place, and the caller's logits stay untouched: a copy where
        # there are edits (a bf16 model's logits become a new float tensor anyway)
        edits = (batch.bitmask, batch.banned_rows, batch.logit_bias, batch.penalties)
        if _needs_float(batch, edits):
            logits = logits.to(torch.float32, copy=any(e is not None for e in edits))
        if batch.bitmask is not None:  # the grammar first, as vLLM: logprobs see it too
            apply_token_bitmask(logits, batch.bitmask, batch.bitmask_rows)
        if batch.banned_rows is not None:
            logits[batch.banned_rows, batch.banned_token_ids] = float("-inf")
        if batch.logit_bias is not None:
            batch.logit_bias.apply(logits)
        if batch.penalties is not None:
            _apply_penalties(logits, batch.penalties)
        logprobs = None if batch.max_num_logprobs is None else logits.log_softmax(dim=-1)
        if batch.all_greedy:
            sampled = _greedy(logits)
        else:
            greedy = _greedy(logits) if batch.any_greedy else None
            sampled, probs = _sample_random(logits, batch, self.generator)
            if greedy is not None:
                sampled = torch.where(batch.greedy_mask, greedy, sampled)
            if batch.keep_probs:
                return _output(sampled, logprobs, batch.max_num_logprobs, probs)
        return _output(sampled, logprobs, batch.max_num_logprobs)


def _apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """In place. Repetition as in CTRL (divide positive, multiply negative logits of seen
    tokens); presence and frequency as in OpenAI's API, over output tokens only."""
    repetition = penalties.repetition.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits.copy_(torch.where(penalties.seen_mask, penalised, logits))
    logits -= penalties.frequency.unsqueeze(1) * penalties.output_counts
    logits -= penalties.presence.unsqueeze(1) * (penalties.output_counts > 0).float()


def _needs_float(batch: SamplingBatch, edits: tuple) -> bool:
    """Whether sampling needs the logits as float32. Not where nothing edits them and they go
    to argmax (exact in bf16: widening keeps every value) or the C draw alone (it widens bf16
    rows itself): a bf16 model's step then writes and reads no float copy of its logits."""
    plain = all(e is None for e in edits) and batch.max_num_logprobs is None
    return not plain or (not batch.all_greedy and (batch.filtered or batch.keep_probs))


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax a row (the first of equal maxima, as argmax): torch's CPU `max` over the last
    dim is the faster of the two (benchmarks/reports/2026-12-03-saturated-step-profile/)."""
    return logits.max(dim=-1).indices


def _sample_random(
    logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Returns int64 [num_rows] (meaningless on greedy rows) and, with `keep_probs`, the
    probabilities drawn from; logits stay as they are. Without filters the temperature goes
    into the draw (no scaled copy of the logits)."""
    if batch.filtered or batch.keep_probs:
        logits = logits / batch.temperature.unsqueeze(1)
        inv_temperature = torch.ones_like(batch.temperature)
    else:
        inv_temperature = 1.0 / batch.temperature
    if batch.min_p is not None:
        _apply_min_p(logits, batch.min_p)
    if not batch.no_top_k_p:
        logits = top_k_top_p(logits, batch.top_k, batch.top_p)
    u = _uniforms(batch, len(logits), logits.device, generator)
    if batch.keep_probs:
        probs = logits.softmax(dim=-1)
        return _inverse_cdf(probs.clone(), u), probs  # the draw sums its copy in place
    drawn = cpu_sampling.draw(logits, inv_temperature, u)  # C, on CPU (none of torch's passes)
    if drawn is None:
        scaled = logits.float() * inv_temperature.unsqueeze(1)
        drawn = _inverse_cdf(scaled.softmax(dim=-1), u)
    return drawn, None


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is below min_p times the most likely one's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, float("-inf"))


def _uniforms(
    batch: SamplingBatch, rows: int, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """One uniform draw a row in [0, 1): a seeded row's from its own (seed, position) stream,
    the others' from the shared generator. One number a row, where an exponential race draws
    one a vocabulary entry: on CPU those draws cost a large part of a small model's step."""
    u = torch.zeros(rows, dtype=torch.float32, device=device)
    if batch.any_unseeded_random:
        u.uniform_(generator=generator)
    if batch.seeded_rows:
        seeded = torch.Generator(device)  # reseeded for each row's draw
        for row, seed in batch.seeded_rows:
            u[row].uniform_(generator=seeded.manual_seed(seed))
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose running mass passes u times the row's total, so token i with
    probability probs[i] (a zero-probability token never: its running mass equals the one
    before); probs are summed in place (kernels/reference.py's draw_ref, the C draw's twin)."""
    cdf = probs.cumsum_(dim=-1)
    target = u.unsqueeze(1) * cdf[:, -1:]  # the row's total, 1 up to rounding
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(cdf.shape[1] - 1)


def _output(
    sampled: torch.Tensor,
    logprobs: torch.Tensor | None,
    max_num_logprobs: int | None,
    probs: torch.Tensor | None = None,
) -> SamplerOutput:
    if logprobs is None or max_num_logprobs is None:
        return SamplerOutput(sampled, None, None, None, probs)
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(max_num_logprobs, dim=-1)
    return SamplerOutput(sampled, sampled_logprobs, top_ids, top_logprobs, probs)
