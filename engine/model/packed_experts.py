"""Routed experts on CPU as oneDNN-prepacked matmuls (engine/model/linear.py's `make_linear`),
one gate_up / down pair per expert, run over the rows of the tokens routed to that expert.

The same math as kernels/reference_moe.py's `fused_moe_ref`, its reference: (token, slot) pairs
sorted by expert, each expert's two matmuls over all its tokens at once, the activation
between them, the rows weighted and added back into their tokens (`index_add_`). Only the
matmuls differ: a weight reordered once into oneDNN's blocked layout instead of MKL re-blocking
it on every call. Under tensor parallelism the stacks hold the rank's intermediate slices.
"""

from collections.abc import Callable

import torch
from kvpager.engine.model.linear import LinearFn, make_linear, onednn_packing_supported
from kvpager.kernels.reference_moe import pairs_by_expert

# The decoder packs its experts in bf16 only (benchmarks/moe_experts.py compares the two). An
# expert gets only T * k / E rows, and oneDNN's linear has a fixed cost a call outside its
# kernel that so few rows do not repay in float32, where MKL's sgemm has no such cost; in bf16
# packing still wins, and torch's bf16 `@` is slower even so.
PACKED_DTYPES = (torch.bfloat16,)


class PackedExperts:
    """Each expert's gate_up [2 * I, H] and down [H, I] packed; the plain stacks stay unused."""

    def __init__(self, gate_up: list[LinearFn], down: list[LinearFn], intermediate: int) -> None:
        self.gate_up, self.down = gate_up, down
        self.intermediate = intermediate  # I: the rank's slice under tensor parallelism

    @classmethod
    def pack(cls, gate_up: torch.Tensor, down: torch.Tensor) -> "PackedExperts | None":
        """gate_up [E, 2 * I, H], down [E, H, I] packed expert by expert; None where oneDNN
        cannot pack them (another device or dtype, or a build without it)."""
        if not onednn_packing_supported(gate_up):
            return None
        gate_up_fns = [make_linear(weight, None, measure=False) for weight in gate_up]
        down_fns = [make_linear(weight, None, measure=False) for weight in down]
        if not all(packed for _, packed in gate_up_fns + down_fns):
            return None
        intermediate = down.shape[2]
        return cls([fn for fn, _ in gate_up_fns], [fn for fn, _ in down_fns], intermediate)

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """hidden [T, H], topk_weights [T, k] in hidden's dtype, topk_ids int [T, k] -> [T, H]."""
        top_k = topk_ids.shape[1]
        flat_weights = topk_weights.flatten()
        out = torch.zeros_like(hidden)
        for expert, pairs in pairs_by_expert(topk_ids, len(self.gate_up)):
            tokens = pairs // top_k
            rows = self.down[expert](activation(self.gate_up[expert](hidden[tokens])))
            out.index_add_(0, tokens, rows * flat_weights[pairs, None])
        return out
