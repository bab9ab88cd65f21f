"""Qwen3-Next's sparse MoE block (transformers' Qwen3NextSparseMoeBlock) as a piece the decoder
selects for a `qwen3_next` model's MoE layers: the routed experts as Qwen3-MoE routes them
(softmax, top k, optionally renormalised: engine/model/moe.py's RoutedExperts) plus one shared
expert, a dense SwiGLU MLP of `shared_expert_intermediate_size`, whose output a per-token gate
scales: sigmoid(h · shared_expert_gate), one scalar a token (Llama 4's shared expert has none).
"""

import torch
import torch.nn.functional as F
from kvpager.engine.model.moe import RoutedExperts
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import KernelOps
from kvpager.schemas.errors import CheckpointError
from torch import nn


def gate_shared_expert(h: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The shared expert's output [T, hidden] scaled by sigmoid(h · gate) (gate [1, hidden])."""
    return torch.sigmoid(F.linear(h, gate)) * shared


class SharedExpertMoe(nn.Module):
    """Routed experts plus a gated shared expert: h [T, hidden] -> [T, hidden]."""

    def __init__(
        self, config: ModelConfig, shared_intermediate: int, dtype: torch.dtype,
        expert_intermediate: int | None = None,
    ) -> None:  # fmt: skip
        """The intermediate widths: a tensor-parallel rank's rows (the model's by default)."""
        super().__init__()
        width = expert_intermediate or config.moe_intermediate_size
        self.experts = RoutedExperts(config, width, dtype)
        hidden, self.shared_intermediate = config.hidden_size, shared_intermediate

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.shared_gate_up = param(2 * shared_intermediate, hidden)  # gate rows, then up
        self.shared_down = param(hidden, shared_intermediate)
        self.shared_expert_gate = param(1, hidden)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor (`mlp.` stripped): the router `gate.weight`, the stacked
        `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (or per expert,
        `experts.<e>.gate_proj.weight`, ..., as save_pretrained writes them), the shared
        expert's gate / up / down and `shared_expert_gate.weight`."""
        target = self._target(name)
        if target is None or target.shape != tensor.shape:
            expected = None if target is None else tuple(target.shape)
            got = tuple(tensor.shape)
            raise CheckpointError(f"mlp.{name}: shape {got}, expected {expected}")
        target.data.copy_(tensor)

    def _target(self, name: str) -> torch.Tensor | None:
        inter, parts = self.shared_intermediate, name.split(".")
        if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit():
            expert, half = int(parts[1]), self.experts.gate_up.shape[1] // 2
            if expert >= self.experts.gate_up.shape[0]:
                return None
            gate_up, down = self.experts.gate_up[expert], self.experts.down[expert]
            rows = {"gate_proj": gate_up[:half], "up_proj": gate_up[half:], "down_proj": down}
            return rows.get(parts[2]) if parts[3] == "weight" else None
        targets = {
            "gate.weight": self.experts.router,
            "experts.gate_up_proj": self.experts.gate_up,
            "experts.down_proj": self.experts.down,
            "shared_expert.gate_proj.weight": self.shared_gate_up[:inter],
            "shared_expert.up_proj.weight": self.shared_gate_up[inter:],
            "shared_expert.down_proj.weight": self.shared_down,
            "shared_expert_gate.weight": self.shared_expert_gate,
        }
        return targets.get(name)

    def forward(self, h: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        routed = self.experts(h, ops.fused_moe, ops.silu_and_mul)
        shared = F.linear(ops.silu_and_mul(F.linear(h, self.shared_gate_up)), self.shared_down)
        return routed + gate_shared_expert(h, shared, self.shared_expert_gate)
