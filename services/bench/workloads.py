"""Seeded benchmark workloads: token-id prompts and fixed output lengths, shared by every engine.

Every request sets its output length and ignores EOS, so each engine does exactly the same work:
`sum(max_tokens * n)` output tokens. Prompts are random token ids drawn from the vocabulary with
special ids left out (a random id that happens to be EOS or a chat marker would not change the
work, but it would make the prompts depend on the tokenizer's special-token layout).

A workload travels as JSON to the vLLM worker, which runs in its own virtualenv.
"""

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # output tokens per sample, generated to the end (ignore_eos)
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return self.max_tokens * self.n


@dataclass
class Workload:
    name: str
    description: str
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def summary(self) -> dict:
        prompt = [len(r.prompt_token_ids) for r in self.requests]
        output = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "description": self.description,
            "num_requests": len(self.requests),
            "num_sequences": sum(r.n for r in self.requests),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "prompt_len_mean_p50_max": _shape(prompt),
            "output_len_mean_p50_max": _shape(output),
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Workload":
        raw = json.loads(text)
        requests = [BenchRequest(**r) for r in raw.pop("requests")]
        return cls(requests=requests, **raw)


def _shape(lengths: list[int]) -> list[float]:
    return [round(float(np.mean(lengths)), 1), float(np.median(lengths)), max(lengths)]


@dataclass(frozen=True)
class TokenSource:
    """Draws prompt ids from [0, vocab_size) minus `special_ids`."""

    vocab_size: int
    special_ids: frozenset[int]

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        ids = rng.integers(0, self.vocab_size, size=count * 2 + 8)
        kept = [int(t) for t in ids if int(t) not in self.special_ids]
        while len(kept) < count:  # only with an absurd share of special ids
            kept += [t for t in self.draw(rng, count) if t not in self.special_ids]
        return kept[:count]


def uniform(source: TokenSource, num_requests: int, prompt_range, output_range, seed: int):
    """Prompt and output lengths uniform over inclusive ranges."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_requests)
    requests = [
        BenchRequest(source.draw(rng, int(p)), int(o)) for p, o in zip(prompt_lens, output_lens)
    ]
    return Workload(
        "uniform",
        f"random lengths: prompt U{list(prompt_range)}, output U{list(output_range)}",
        requests,
    )


def sharegpt_like(
    source: TokenSource,
    num_requests: int,
    prompt_median: int,
    output_median: int,
    max_len: int,
    seed: int,
    sigma: float = 1.0,
):
    """Long-tailed lengths: lognormal around the medians, clipped to [4, max_len] each.

    The shape (a heavy right tail: most conversations short, a few very long) is what ShareGPT
    shows; the medians are scaled down so a CPU run finishes. No real dataset is read.
    """
    rng = np.random.default_rng(seed)

    def draw(median: int) -> np.ndarray:
        lengths = rng.lognormal(np.log(median), sigma, size=num_requests)
        return np.clip(np.rint(lengths), 4, max_len).astype(int)

    prompt_lens, output_lens = draw(prompt_median), draw(output_median)
    requests = [
        BenchRequest(source.draw(rng, int(p)), int(o)) for p, o in zip(prompt_lens, output_lens)
    ]
    return Workload(
        "sharegpt-like",
        f"lognormal(sigma {sigma}) lengths, medians prompt {prompt_median} / output "
        f"{output_median}, clipped to {max_len}",
        requests,
    )


def fixed_output(
    source: TokenSource,
    num_requests: int,
    prompt_median: int,
    max_prompt: int,
    output_len: int,
    seed: int,
    sigma: float = 1.0,
):
    """Prefill-heavier: lognormal prompts clipped to [4, max_prompt], every output `output_len`
    tokens, so most steps run the whole batch (the saturated shape vLLM's graph does well on)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(prompt_median), sigma, size=num_requests)
    prompt_lens = np.clip(np.rint(lengths), 4, max_prompt).astype(int)
    requests = [BenchRequest(source.draw(rng, int(p)), output_len) for p in prompt_lens]
    return Workload(
        "fixed-output",
        f"lognormal(sigma {sigma}) prompts, median {prompt_median}, clipped to {max_prompt}; "
        f"every output {output_len} tokens",
        requests,
    )


def shared_prefix(
    source: TokenSource, num_requests: int, prefix_len: int, suffix_range, output_range, seed: int
):
    """One system prompt of `prefix_len` ids in front of every request's own suffix."""
    rng = np.random.default_rng(seed)
    prefix = source.draw(rng, prefix_len)
    requests = []
    for _ in range(num_requests):
        suffix = source.draw(rng, int(rng.integers(suffix_range[0], suffix_range[1] + 1)))
        output = int(rng.integers(output_range[0], output_range[1] + 1))
        requests.append(BenchRequest(prefix + suffix, output))
    return Workload(
        "shared-prefix",
        f"{prefix_len}-token system prompt + suffix U{list(suffix_range)}, output "
        f"U{list(output_range)}",
        requests,
    )


def multi_prefix(
    source: TokenSource,
    num_systems: int,
    users_per_system: int,
    system_len: int,
    suffix_range,
    output_len: int,
    seed: int,
):
    """`num_systems` system prompts of `system_len` ids, each in front of `users_per_system`
    users' own suffixes; the requests in a seeded random order, so the systems interleave as
    a replica's router sees them."""
    rng = np.random.default_rng(seed)
    systems = [source.draw(rng, system_len) for _ in range(num_systems)]
    requests = []
    for system in systems:
        for _ in range(users_per_system):
            suffix = source.draw(rng, int(rng.integers(suffix_range[0], suffix_range[1] + 1)))
            requests.append(BenchRequest(system + suffix, output_len))
    order = rng.permutation(len(requests))
    return Workload(
        "multi-prefix",
        f"{num_systems} system prompts of {system_len} tokens x {users_per_system} users, suffix "
        f"U{list(suffix_range)}, output {output_len}, shuffled",
        [requests[int(i)] for i in order],
    )


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of `rate`
    requests/s (exponential gaps, the first at 0); every one at 0 when the rate is infinite."""
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(0, num_requests - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]


def parallel_sampling(
    source: TokenSource, num_requests: int, n: int, prompt_range, output_range, seed: int
):
    """n samples per prompt at temperature 1 (seeded per request): forks share the prompt."""
    base = uniform(source, num_requests, prompt_range, output_range, seed)
    requests = [
        BenchRequest(r.prompt_token_ids, r.max_tokens, n=n, temperature=1.0, seed=seed + i)
        for i, r in enumerate(base.requests)
    ]
    return Workload(
        f"parallel-n{n}",
        f"n={n} samples at temperature 1; prompt U{list(prompt_range)}, output "
        f"U{list(output_range)}",
        requests,
    )
