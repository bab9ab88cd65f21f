"""Routed experts (Mixtral, Qwen3-MoE, gpt-oss: engine/model/gpt_oss.py, Llama 4): a router
picks each token's top-k experts, the backend's `fused_moe` runs them (kernels/reference.py's
twin: one matmul pair per expert over the tokens routed to it; kernels/moe.py on CUDA). Once the
decoder packs its weights on CPU, in bf16, engine/model/packed_experts.py runs them instead:
the twin's loop on oneDNN-packed matmuls.

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension
(engine/model/sharding.py) and the whole router, so the routing is the same on every rank and
the decoder all-reduces the output as it does a dense MLP's.

Llama 4 routes otherwise (`moe_router` "llama4"): the sigmoid of each chosen expert's logit
scales that expert's input, not its output, so each top-k slot runs as its own pass with
weight 1 (Llama 4 itself routes top 1: one pass).
"""

from functools import partial

import torch
import torch.nn.functional as F
from kvpager.engine.model.deepseek_router import route_grouped, route_softmax_grouped
from kvpager.engine.model.gpt_oss import route_top_logits
from kvpager.engine.model.linear import release
from kvpager.engine.model.packed_experts import PACKED_DTYPES, PackedExperts
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.reference import clamped_swiglu_ref
from kvpager.kernels.reference_moe import fused_moe_ref
from torch import nn


def route(
    router_logits: torch.Tensor, top_k: int, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]) as transformers routes: softmax
    in fp32, top k, optionally renormalised over those k."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class RoutedExperts(nn.Module):
    """A layer's router and experts; `gate_up` [E, 2 * I_rank, H], `down` [E, H, I_rank];
    gpt-oss's biases beside them. Under tensor parallelism only rank 0 (`add_down_bias`) adds
    the down bias: the ranks' outputs are summed."""

    def __init__(
        self, config: ModelConfig, intermediate: int, dtype: torch.dtype, add_down_bias: bool = True
    ) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.gpt_oss = config.gpt_oss_experts
        self.add_down_bias = add_down_bias
        self.scales_inputs = config.moe_router == "llama4"
        # DeepSeek V3's and V2's routers (deepseek_router.py)
        self.grouped = config.moe_router in ("deepseek", "deepseek_v2")
        self.v2_router = config.moe_router == "deepseek_v2"
        self.expert_groups, self.scaling = config.expert_groups, config.routed_scaling_factor
        num_experts, hidden = config.num_experts, config.hidden_size

        def param(*shape: int, on: bool = True) -> nn.Parameter | None:
            empty = torch.empty(*shape, dtype=dtype)
            return nn.Parameter(empty, requires_grad=False) if on else None

        self.router = param(num_experts, hidden)
        if self.grouped:  # fp32, as transformers keeps them
            self.router = nn.Parameter(self.router.float(), requires_grad=False)
        self.correction_bias = None
        if self.grouped and not self.v2_router:
            bias = torch.empty(num_experts, dtype=torch.float32)
            self.correction_bias = nn.Parameter(bias, requires_grad=False)
        # gate rows, then up rows (Nemotron-H's ungated experts: up rows alone)
        self.gate_up = param(num_experts, (1 + config.gated_mlp) * intermediate, hidden)
        self.down = param(num_experts, hidden, intermediate)
        self.router_bias = param(num_experts, on=self.gpt_oss)
        self.gate_up_bias = param(num_experts, 2 * intermediate, on=self.gpt_oss)
        self.down_bias = param(num_experts, hidden, on=self.gpt_oss)
        self.gpt_oss_activation = partial(
            clamped_swiglu_ref, alpha=config.swiglu_alpha, limit=config.swiglu_limit
        )
        self.packed: PackedExperts | None = None

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def build_matmuls(self, pack: bool) -> None:
        """Packs every expert where oneDNN can and that pays (bf16: packed_experts.py); then the
        plain stacks, copies, are released."""
        if self.gpt_oss:  # biased experts stay on the twin's loop (gpt_oss.py)
            return
        if pack and not self.is_packed and self.gate_up.dtype in PACKED_DTYPES:
            self.packed = PackedExperts.pack(self.gate_up, self.down)
            if self.is_packed:
                release(self.gate_up)
                release(self.down)

    def forward(self, h: torch.Tensor, fused_moe, activation) -> torch.Tensor:
        """h [T, H] -> [T, H] (this rank's partial sum under tensor parallelism)."""
        if self.gpt_oss:
            return self._gpt_oss(h)
        if self.v2_router:
            weights, ids = route_softmax_grouped(
                h, self.router, self.top_k, self.expert_groups, self.scaling
            )
            return self._run(h, weights, ids, fused_moe, activation)
        if self.grouped:
            weights, ids = route_grouped(
                h, self.router, self.correction_bias, self.top_k, self.expert_groups,
                self.renormalise, self.scaling,
            )  # fmt: skip
            return self._run(h, weights, ids, fused_moe, activation)
        logits = F.linear(h, self.router)
        if self.scales_inputs:
            return self._scaled_inputs(h, logits, fused_moe, activation)
        weights, ids = route(logits, self.top_k, self.renormalise)
        return self._run(h, weights, ids, fused_moe, activation)

    def _run(self, h, weights, ids, fused_moe, activation) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(h, weights, ids, activation)
        return fused_moe(h, self.gate_up, self.down, weights, ids, activation)

    def _gpt_oss(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = route_top_logits(F.linear(h, self.router, self.router_bias), self.top_k)
        down_bias = self.down_bias if self.add_down_bias else None
        return fused_moe_ref(
            h, self.gate_up, self.down, weights, ids, self.gpt_oss_activation,
            gate_up_bias=self.gate_up_bias, down_bias=down_bias,
        )  # fmt: skip

    def _scaled_inputs(self, h, logits, fused_moe, activation) -> torch.Tensor:
        """Llama 4: sum over the top-k slots of expert(h * sigmoid(logit)), as transformers'
        Llama4TextMoe computes it (the sigmoid in fp32, rounded to h's dtype)."""
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(values.float()).to(h.dtype)  # [T, k]
        ones = torch.ones_like(scores[:, :1])
        out = None
        for slot in range(self.top_k):
            scaled = h * scores[:, slot : slot + 1]
            part = self._run(scaled, ones, ids[:, slot : slot + 1], fused_moe, activation)
            out = part if out is None else out + part
        return out
