"""KV-cache sizing: bytes per token and sequence, and how many sequences a budget holds.

Contiguous serving reserves `max_tokens` slots per sequence up front; paging allocates blocks as
tokens arrive, so a sequence of average length L holds ceil(L / block_size) blocks and wastes
less than one block.
"""

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class KvSizeReport:
    bytes_per_token: int
    bytes_per_sequence: int  # at max_tokens
    total_bytes: int  # users x bytes_per_sequence
    budget_bytes: int
    contiguous_sequences: int  # fit when each reserves max_tokens
    paged_sequences: int  # fit when each holds blocks for avg_tokens
    paged_utilisation: float  # stored tokens / allocated slots under paging

    def lines(self) -> list[str]:
        gib = 1024**3
        return [
            f"KV bytes per token:        {self.bytes_per_token:,}",
            f"KV bytes per sequence:     {self.bytes_per_sequence:,} "
            f"({self.bytes_per_sequence / gib:.2f} GiB)",
            f"KV bytes for all users:    {self.total_bytes:,} ({self.total_bytes / gib:.2f} GiB)",
            f"budget:                    {self.budget_bytes:,} ({self.budget_bytes / gib:.2f} GiB)",
            f"sequences that fit, contiguous max-length reservation: {self.contiguous_sequences}",
            f"sequences that fit, paged at the average length:       {self.paged_sequences} "
            f"(slot utilisation {self.paged_utilisation:.1%})",
        ]


def kv_size(
    config: ModelConfig,
    dtype: torch.dtype,
    max_tokens: int,
    users: int,
    budget_bytes: int,
    avg_tokens: int,
    block_size: int = 16,
) -> KvSizeReport:
    per_token = config.kv_bytes_per_token(dtype)
    blocks_per_avg = -(-avg_tokens // block_size)
    return KvSizeReport(
        bytes_per_token=per_token,
        bytes_per_sequence=per_token * max_tokens,
        total_bytes=per_token * max_tokens * users,
        budget_bytes=budget_bytes,
        contiguous_sequences=budget_bytes // (per_token * max_tokens),
        paged_sequences=budget_bytes // (per_token * blocks_per_avg * block_size),
        paged_utilisation=avg_tokens / (blocks_per_avg * block_size),
    )
