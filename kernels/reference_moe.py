"""The torch twin of routed experts (kernels/moe.py's Triton kernel and
engine/model/packed_experts.py's packed matmuls): each token's top-k experts' gated MLPs,
weighted and summed, in plain `@` per expert."""

from collections.abc import Callable, Iterator

import torch
from kvpager.kernels.reference import silu_and_mul_ref


def fused_moe_ref(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts: each token's top-k experts' gated MLPs, weighted and summed.

    hidden [T, H]; gate_up [E, 2 * I, H] (gate rows first); down [E, H, I]; topk_weights
    [T, k] in hidden's dtype; topk_ids int [T, k]; gpt-oss's biases, gate_up_bias [E, 2 * I]
    and down_bias [E, H], or None. Returns [T, H] in hidden's dtype. The
    (token, slot) pairs are sorted by expert, so each expert runs two matmuls over all its
    tokens at once; results are added back into their tokens' rows (index_add_)."""
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    for expert, pairs in pairs_by_expert(topk_ids, gate_up.shape[0]):
        tokens = pairs // top_k
        gate_up_rows = hidden[tokens] @ gate_up[expert].t()
        if gate_up_bias is not None:
            gate_up_rows = gate_up_rows + gate_up_bias[expert]
        rows = activation(gate_up_rows) @ down[expert].t()
        if down_bias is not None:
            rows = rows + down_bias[expert]
        out.index_add_(0, tokens, rows * topk_weights.flatten()[pairs, None])
    return out


def pairs_by_expert(topk_ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its pairs) for each expert with tokens; topk_ids [T, k], pair p = token * k +
    slot, each expert's pairs in token order (a stable sort)."""
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, order[start : start + count]
        start += count
