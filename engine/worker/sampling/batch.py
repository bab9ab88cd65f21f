"""One step's sampling parameters as tensors (SamplingBatch.build), which sampler.py reads:
built from each row's SamplingParams, its output position (a seeded row's draw) and its prompt
and output tokens (penalties, min_tokens); features no row uses stay None, so the sampler
skips them.
"""

from dataclasses import dataclass

import torch
from kvpager.schemas.sampling import SamplingParams

# Temperatures below this are greedy: dividing by them overflows float32 logits.
_MIN_TEMPERATURE = 1e-5
_MASK_64 = (1 << 64) - 1
_MASK_63 = (1 << 63) - 1


@dataclass
class PenaltyTensors:
    """Repetition, presence and frequency penalties of one step (rows = sampled sequences)."""

    repetition: torch.Tensor  # float32 [num_rows]; 1.0 = off
    presence: torch.Tensor  # float32 [num_rows]; 0.0 = off
    frequency: torch.Tensor  # float32 [num_rows]; 0.0 = off
    seen_mask: torch.Tensor  # bool [num_rows, vocab]: token in prompt or output
    output_counts: torch.Tensor  # float32 [num_rows, vocab]: occurrences in the output


@dataclass
class SamplingBatch:
    """Tensors for one step; row i samples the next token of sequence i.

    Optional fields are None when no row uses the feature, so the common cases skip the work.
    """

    temperature: torch.Tensor  # float32 [num_rows]; 1.0 on greedy rows so dividing is harmless
    greedy_mask: torch.Tensor  # bool [num_rows]
    all_greedy: bool
    any_greedy: bool
    seeded_rows: list[tuple[int, int]]  # random rows with a seed: (row, seed of this draw)
    any_unseeded_random: bool  # some random row draws from the shared (global) generator
    top_k: torch.Tensor | None  # int64 [num_rows]; vocab_size where disabled
    top_p: torch.Tensor | None  # float32 [num_rows]; 1.0 where disabled
    min_p: torch.Tensor | None  # float32 [num_rows]; 0.0 where disabled
    penalties: PenaltyTensors | None
    banned_rows: torch.Tensor | None  # int64 [num_banned]: with banned_token_ids, the
    banned_token_ids: torch.Tensor | None  # (row, token) pairs min_tokens forbids this step
    max_num_logprobs: int | None  # most top logprobs any row asked for; None: no row asked
    # structured outputs: int32 [num_masked, ceil(vocab / 32)] grammar masks of these rows
    bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None  # int64 [num_masked]
    logit_bias: "LogitBias | None" = None  # OpenAI's logit_bias of the rows that have one
    keep_probs: bool = False  # return what random rows drew from (draft-model verification)

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def no_top_k_p(self) -> bool:
        return self.top_k is None and self.top_p is None

    @property
    def filtered(self) -> bool:  # some row's distribution is cut (min-p, top-k or top-p)
        return self.min_p is not None or not self.no_top_k_p

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seed_positions: list[int],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        """Gather one step's per-row parameters into tensors on `device`.

        `seed_positions[i]`: the output position row i samples (counted from the request's
        first output token, earlier runs included); it matters only on seeded rows.
        """
        num_rows = len(params)
        assert len(seed_positions) == len(prompt_token_ids) == len(output_token_ids) == num_rows, (
            "one seed position, prompt and output per row"
        )
        greedy = [_is_greedy(p) for p in params]
        random_rows = [i for i in range(num_rows) if not greedy[i]]
        seeded_rows = [
            (i, draw_seed(seed, seed_positions[i]))
            for i in random_rows
            if (seed := params[i].seed) is not None
        ]
        banned_rows, banned_ids = _min_tokens_bans(
            params, output_token_ids, eos_token_ids, vocab_size
        )
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=_floats(_random_row_values(params, greedy, "temperature", 1.0), device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            seeded_rows=seeded_rows,
            any_unseeded_random=len(seeded_rows) < len(random_rows),
            top_k=_top_k(params, greedy, vocab_size, device),
            top_p=_unless_neutral(_random_row_values(params, greedy, "top_p", 1.0), 1.0, device),
            min_p=_unless_neutral(_random_row_values(params, greedy, "min_p", 0.0), 0.0, device),
            penalties=_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
            banned_rows=_ints(banned_rows, device) if banned_rows else None,
            banned_token_ids=_ints(banned_ids, device) if banned_rows else None,
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            logit_bias=LogitBias.build(params, vocab_size, device),
        )


@dataclass
class LogitBias:
    """(row, token, bias) triples, added to the logits (OpenAI's `logit_bias`)."""

    rows: torch.Tensor  # int64 [num_biased]
    token_ids: torch.Tensor  # int64 [num_biased]
    values: torch.Tensor  # float32 [num_biased]

    @classmethod
    def build(
        cls, params: list[SamplingParams], vocab_size: int, device: torch.device
    ) -> "LogitBias | None":
        """None when no row has a bias; ids past the logits (checked on the input path
        already) are left out rather than indexed."""
        triples = [
            (row, token_id, bias)
            for row, p in enumerate(params)
            for token_id, bias in (p.logit_bias or {}).items()
            if token_id < vocab_size
        ]
        if not triples:
            return None
        rows, token_ids, values = zip(*triples, strict=True)
        return cls(
            _ints(list(rows), device), _ints(list(token_ids), device), _floats(list(values), device)
        )

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)


def draw_seed(seed: int, position: int) -> int:
    """The seed of one draw: a stable mix (splitmix64) of the request's seed and the output
    position, so neighbouring positions and seeds give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (z ^ (z >> 31)) & _MASK_63  # manual_seed takes a non-negative int64


def _is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy or params.temperature < _MIN_TEMPERATURE


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _random_row_values(
    params: list[SamplingParams], greedy: list[bool], name: str, neutral: float
) -> list[float]:
    """A sampling knob per row, neutral on greedy rows (which never use it)."""
    return [neutral if g else getattr(p, name) for p, g in zip(params, greedy, strict=True)]


def _unless_neutral(
    values: list[float], neutral: float, device: torch.device
) -> torch.Tensor | None:
    """None when every row holds the neutral value, so the filter is skipped."""
    return None if all(v == neutral for v in values) else _floats(values, device)


def _top_k(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    top_k = [
        vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size)
        for p, g in zip(params, greedy, strict=True)
    ]
    return None if all(k == vocab_size for k in top_k) else _ints(top_k, device)


def _min_tokens_bans(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: list[int],
    vocab_size: int,
) -> tuple[list[int], list[int]]:
    """(row, token) pairs to forbid: EOS (unless ignore_eos) and stop tokens before min_tokens.

    Ids outside the vocabulary can never be sampled, so they need no ban (and would not index).
    """
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        in_vocab = sorted(t for t in banned if t < vocab_size)
        rows.extend([row] * len(in_vocab))
        token_ids.extend(in_vocab)
    return rows, token_ids


def _penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    repetition = [p.repetition_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    if all(r == 1.0 for r in repetition) and not any(presence) and not any(frequency):
        return None
    output_counts = _token_counts(output_token_ids, vocab_size, device)
    seen_mask = output_counts > 0
    if any(r != 1.0 for r in repetition):  # only repetition looks at the prompt
        seen_mask |= _token_counts(prompt_token_ids, vocab_size, device) > 0
    return PenaltyTensors(
        repetition=_floats(repetition, device),
        presence=_floats(presence, device),
        frequency=_floats(frequency, device),
        seen_mask=seen_mask,
        output_counts=output_counts,
    )


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """float32 [num_rows, vocab_size]: how often each token occurs in each row's list."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Pad with vocab_size: an extra column, counted then dropped.
    padded = _ints([ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids], device)
    padded = padded.view(len(token_ids), max_len)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
