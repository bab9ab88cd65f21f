"""Qwen3-Next's gated DeltaNet layer (`linear_attention` in its `layer_types`) over a batch of
sequences, each reading and updating its own recurrent state slot, with the Mamba2 mixer's
calling convention (engine/model/mamba2.py), so the decoder maps such layers to it alike.

Per token: in_proj_qkvz -> q, k [Hk, K], v, z [H, V] and in_proj_ba -> b, a [H] (Qwen3-Next's
checkpoint groups them per key head, Qwen3.5's (`qwen3_5` text) keeps them apart: both load
into one flat layout); a causal depthwise conv1d with SiLU over q | k | v (state: the last
kernel - 1 inputs); q and k L2-normalised, q scaled by K^-0.5; beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule (kernels/gated_delta_rule.py;
state [H, K, V] float32); a gated RMSNorm per value head (normalise, times its weight, times
silu(z)); out_proj.

A prefill chunk runs the chunked rule from the slot's state, a decode token one step; on CUDA
prefill chunks go through the chunked Triton kernel (kernels/gated_delta_rule_chunk_triton.py),
decode tokens through the token-by-token one (kernels/gated_delta_rule_triton.py). Chunked
prefill and decode compose into the same result as one pass
(tests/engine/model/test_gated_deltanet.py).
The states reuse `RecurrentStates` (conv [layers, slots, conv_dim, kernel - 1], recurrent
[layers, slots, H, K, V] float32): reset and fork copy are the same.
"""

import torch
import torch.nn.functional as F
from kvpager.engine.families.qwen3_next import DeltaNetDims
from kvpager.engine.model.mamba2 import RecurrentStates
from kvpager.kernels.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_step,
    normalise_qk,
)
from kvpager.kernels.mamba2_scan import causal_conv1d, causal_conv1d_step
from kvpager.schemas.errors import CheckpointError

__all__ = ["CHECKPOINT_TENSORS", "DeltaNetDims", "GatedDeltaNet", "allocate_states"]

# checkpoint name after `linear_attn.` -> GatedDeltaNet attribute (conv1d.weight is [C, 1, K]).
# Qwen3-Next groups in_proj_qkvz / in_proj_ba per key head (regrouped at load: `_flat_rows`);
# Qwen3.5 has them apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), already flat.
CHECKPOINT_TENSORS = {
    "in_proj_qkvz.weight": "in_proj_qkvz",
    "in_proj_ba.weight": "in_proj_ba",
    "in_proj_qkv.weight": "in_proj_qkvz",
    "in_proj_z.weight": "in_proj_qkvz",
    "in_proj_b.weight": "in_proj_ba",
    "in_proj_a.weight": "in_proj_ba",
    "conv1d.weight": "conv_weight",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "norm.weight": "norm_weight",
    "out_proj.weight": "out_proj",
}


def allocate_states(
    dims: DeltaNetDims, num_layers: int, num_slots: int, dtype: torch.dtype, device
) -> RecurrentStates:
    """Zeroed states of `num_layers` DeltaNet layers: conv in `dtype`, the rule's in float32."""
    conv = (num_layers, num_slots, dims.conv_dim, dims.conv_kernel - 1)
    rule = (num_layers, num_slots, dims.num_value_heads, dims.key_head_dim, dims.value_head_dim)
    return RecurrentStates(
        torch.zeros(conv, dtype=dtype, device=device),
        torch.zeros(rule, dtype=torch.float32, device=device),
    )


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, dims: DeltaNetDims, dtype: torch.dtype, triton: bool | None = None) -> None:
        """`triton`: run the rule on the Triton varlen kernel (None: on CUDA tensors)."""
        super().__init__()
        self.dims, self.triton = dims, triton

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

        self.in_proj_qkvz = param(2 * dims.key_dim + 2 * dims.value_dim, dims.hidden_size)
        self.in_proj_ba = param(2 * dims.num_value_heads, dims.hidden_size)
        self.conv_weight = param(dims.conv_dim, dims.conv_kernel)
        self.dt_bias, self.A_log = param(dims.num_value_heads), param(dims.num_value_heads)
        self.norm_weight = param(dims.value_head_dim)
        self.out_proj = param(dims.hidden_size, dims.value_dim)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor (`linear_attn.` stripped; see CHECKPOINT_TENSORS)."""
        if name not in CHECKPOINT_TENSORS:
            raise CheckpointError(f"linear_attn.{name}: not a gated DeltaNet tensor")
        target = getattr(self, CHECKPOINT_TENSORS[name])
        d = self.dims
        rows = {
            "in_proj_qkv.weight": slice(0, d.conv_dim),
            "in_proj_z.weight": slice(d.conv_dim, None),
            "in_proj_b.weight": slice(0, d.num_value_heads),
            "in_proj_a.weight": slice(d.num_value_heads, None),
        }
        target = target[rows[name]] if name in rows else target
        if name == "conv1d.weight" and tensor.numel() == target.numel():
            tensor = tensor.reshape(target.shape)  # [C, 1, K] -> [C, K]
        if tensor.shape != target.shape:
            got, expected = tuple(tensor.shape), tuple(target.shape)
            raise CheckpointError(f"linear_attn.{name}: shape {got}, expected {expected}")
        if name in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
            tensor = self._flat_rows(tensor, name == "in_proj_ba.weight")
        target.data.copy_(tensor)

    def _flat_rows(self, weight: torch.Tensor, ba: bool) -> torch.Tensor:
        """Qwen3-Next's rows, per key head [q, k, its value heads' v, their z] (or [b, a]), as
        the flat [q | k | v | z] (or [b | a]) the forward splits."""
        d = self.dims
        per_key = d.num_value_heads // d.num_key_heads
        sizes = [per_key] * 2 if ba else [d.key_head_dim] * 2 + [per_key * d.value_head_dim] * 2
        parts = weight.view(d.num_key_heads, sum(sizes), -1).split(sizes, dim=1)
        return torch.cat([part.reshape(-1, weight.shape[-1]) for part in parts])

    def forward(
        self,
        hidden: torch.Tensor,
        seq_lens: list[int],
        slots: list[int],
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [T, hidden]: the sequences' tokens back to back, `seq_lens` each, sequence i
        in state slot `slots[i]` of this layer's conv_states [slots, ...] / recurrent_states."""
        d = self.dims
        mixed, z, b, a = self._project(hidden)
        beta = torch.sigmoid(b)
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        batch = _Batch(seq_lens, slots, hidden.device)
        conv = self._conv(mixed, batch, conv_states)
        q, k, v = conv.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        num_tokens = hidden.shape[0]
        q, k = normalise_qk(
            q.reshape(num_tokens, d.num_key_heads, d.key_head_dim),
            k.reshape(num_tokens, d.num_key_heads, d.key_head_dim),
        )
        v = v.reshape(num_tokens, d.num_value_heads, d.value_head_dim)
        core = self._rule(q, k, v, g, beta, batch, recurrent_states)
        return self._out(core.to(hidden.dtype), z)

    def _project(self, hidden: torch.Tensor):
        """(q | k | v [T, conv_dim], z [T, H, V], b [T, H], a [T, H])."""
        d, n = self.dims, hidden.shape[0]
        mixed, z = F.linear(hidden, self.in_proj_qkvz).split([d.conv_dim, d.value_dim], dim=-1)
        b, a = F.linear(hidden, self.in_proj_ba).split(d.num_value_heads, dim=-1)
        return mixed, z.reshape(n, d.num_value_heads, d.value_head_dim), b, a

    def _conv(self, mixed, batch: "_Batch", conv_states) -> torch.Tensor:
        """The short convolution: each prefill chunk from its slot's state, every decode token
        in one batched step."""
        out = torch.empty_like(mixed)
        for rows, slot in batch.prefills:
            out[rows] = causal_conv1d(mixed[rows], conv_states[slot], self.conv_weight, None)
        if batch.step_rows:
            rows, index = batch.step_rows, batch.step_slots
            step = causal_conv1d_step
            if self._on_triton(mixed):
                from kvpager.kernels.mamba2_triton import causal_conv1d_step_triton as step
            out[rows] = step(mixed[rows], conv_states, index, self.conv_weight, None)
        return out

    def _on_triton(self, x: torch.Tensor) -> bool:
        return bool(self.triton or (self.triton is None and x.is_cuda))

    def _rule(self, q, k, v, g, beta, batch: "_Batch", states) -> torch.Tensor:
        """The gated delta rule of every sequence: o [T, H, V] float32."""
        if self._on_triton(v):
            return _rule_triton(q, k, v, g, beta, batch, states)
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for rows, slot in batch.prefills:
            args = (q[rows], k[rows], v[rows], g[rows], beta[rows])
            out[rows] = gated_delta_rule_chunked(*args, states[slot], self.dims.chunk_size)
        if batch.step_rows:
            rows, index = batch.step_rows, batch.step_slots
            seq_states = states[index]
            args = (q[rows], k[rows], v[rows], g[rows], beta[rows])
            out[rows] = gated_delta_rule_step(*args, seq_states)
            states[index] = seq_states
        return out

    def _out(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm per value head (transformers' Qwen3NextRMSNormGated: the weight
        scales in the model's dtype, the SiLU gate in float32) and out_proj."""
        x = core.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.dims.eps)
        x = self.norm_weight * x.to(core.dtype)
        x = (x * F.silu(z.float())).to(core.dtype)
        return F.linear(x.reshape(core.shape[0], -1), self.out_proj)


def _rule_triton(q, k, v, g, beta, batch: "_Batch", states) -> torch.Tensor:
    """Prefill chunks on the chunked kernel, decode tokens on the token-by-token one."""
    from kvpager.kernels.gated_delta_rule_chunk_triton import chunk_gated_delta_rule_varlen
    from kvpager.kernels.gated_delta_rule_triton import gated_delta_rule_varlen

    if not batch.prefills:
        return gated_delta_rule_varlen(q, k, v, g, beta, batch.cu_seqlens, batch.slots, states)
    out = chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, batch.cu_seqlens, batch.slots, states,
        seq_ids=batch.prefill_ids,
    )  # fmt: skip
    if batch.step_rows:
        rows = batch.step_rows
        one_each = torch.arange(len(rows) + 1, dtype=torch.int32, device=v.device)
        args = (q[rows], k[rows], v[rows], g[rows], beta[rows])
        out[rows] = gated_delta_rule_varlen(*args, one_each, batch.step_slots, states)
    return out


class _Batch:
    """Where each sequence of a flat batch lies: prefill chunks (rows, slot) one by one,
    decode tokens (one row each) together; and the varlen kernel's cu_seqlens and slots."""

    def __init__(self, seq_lens: list[int], slots: list[int], device) -> None:
        bounds = [0]
        for n in seq_lens:
            bounds.append(bounds[-1] + n)
        self.prefills = [
            (slice(bounds[i], bounds[i + 1]), slot)
            for i, (n, slot) in enumerate(zip(seq_lens, slots))
            if n > 1
        ]
        steps = [i for i, n in enumerate(seq_lens) if n == 1]
        prefill_ids = [i for i, n in enumerate(seq_lens) if n > 1]
        self.prefill_ids = torch.tensor(prefill_ids, dtype=torch.int64, device=device)
        self.step_rows = [bounds[i] for i in steps]
        self.step_slots = torch.tensor([slots[i] for i in steps], device=device)
        self.cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
