"""The Mamba2 mixer (Granite 4's `granitemoehybrid`, Nemotron-H, Falcon-H1 layers) over a
batch of sequences, each reading and updating its own recurrent state slot.

A mixer computes, per token: in_proj -> (gate z, conv input xBC, dt); a causal depthwise
conv1d with SiLU over xBC (state: the last d_conv - 1 inputs); x, B, C split from it;
dt = softplus(dt + dt_bias) (in the model's dtype), clamped to time_step_limit on prompt tokens;
the selective scan with A = -exp(A_log) and the D skip (state: [heads, head_dim, d_state]); a
gated RMSNorm (y * silu(z), normalised per group of intermediate / n_groups channels, times its
weight, in fp32, rounded once); out_proj.

The state does not grow with the sequence: a sequence holds one slot of `RecurrentStates`
(engine/kv/state_slots.py hands the slot ids out; the executor owns the tensors). A prefill
chunk runs the chunked scan from the slot's state, a decode token one step: chunked prefill
and decode compose into the same result as one pass (tests/engine/model/test_mamba2.py).
On CUDA both run on the Triton kernels (kernels/mamba2_triton.py); on CPU the decode step's
state update runs on the C kernel where it builds (kernels/cpu_mamba2.py).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvpager.engine.mamba2_config import Mamba2Dims
from kvpager.engine.model.sharding import Mamba2Shard
from kvpager.engine.parallel.group import TensorParallel
from kvpager.kernels.cpu_mamba2 import ssm_step_cpu
from kvpager.kernels.mamba2_scan import causal_conv1d, ssm_scan_chunked

__all__ = ["Mamba2Dims", "Mamba2Mixer", "RecurrentStates"]


@dataclass
class RecurrentStates:
    """Every Mamba layer's state slots: conv [layers, slots, conv_dim, d_conv - 1] and
    ssm [layers, slots, heads, head_dim, d_state], the SSM state in float32 (the scan's)."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def allocate(
        cls, dims: Mamba2Dims, num_layers: int, num_slots: int, dtype, device
    ) -> "RecurrentStates":
        conv = (num_layers, num_slots, dims.conv_dim, dims.conv_kernel - 1)
        ssm = (num_layers, num_slots, dims.num_heads, dims.head_dim, dims.state_size)
        return cls(
            torch.zeros(conv, dtype=dtype, device=device),
            torch.zeros(ssm, dtype=torch.float32, device=device),
        )

    def reset(self, slots: list[int]) -> None:
        """A new sequence starts from zeros (a slot is reused after its last owner)."""
        self.conv[:, slots] = 0
        self.ssm[:, slots] = 0

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Forks (n > 1, beams): each (source, destination) slot copied in every layer."""
        for src, dst in pairs:
            self.conv[:, dst] = self.conv[:, src]
            self.ssm[:, dst] = self.ssm[:, src]


class Mamba2Mixer(torch.nn.Module):
    def __init__(
        self, dims: Mamba2Dims, dtype: torch.dtype, bias: bool, conv_bias: bool,
        shard: Mamba2Shard | None = None, group: TensorParallel | None = None,
        triton: bool | None = None,
    ) -> None:  # fmt: skip
        """`dims` the model's; under tensor parallelism the rank's `shard` of them (its heads:
        engine/model/sharding.py, Mamba2Shard) and its `group`, for the norm's sums across
        ranks. `triton`: scan and step on the Triton kernels (None: on CUDA tensors)."""
        super().__init__()
        self.shard, self.group, self.triton = shard or Mamba2Shard(dims), group, triton
        self.dims = dims = self.shard.dims
        self.adds_out_bias = self.shard.rank == 0  # out_proj's bias once, before the all-reduce
        proj = dims.intermediate_size + dims.conv_dim + dims.num_heads

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

        self.in_proj = param(proj, dims.hidden_size)
        self.in_proj_bias = param(proj) if bias else None
        self.conv_weight = param(dims.conv_dim, dims.conv_kernel)
        self.conv_bias = param(dims.conv_dim) if conv_bias else None
        self.dt_bias, self.A_log, self.D = (
            param(dims.num_heads),
            param(dims.num_heads),
            param(dims.num_heads),
        )
        self.norm_weight = param(dims.intermediate_size)
        self.out_proj = param(dims.hidden_size, dims.intermediate_size)
        self.out_proj_bias = param(dims.hidden_size) if bias else None

    def forward(
        self,
        hidden: torch.Tensor,
        seq_lens: list[int],
        slots: list[int],
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        cuts: list[list[tuple[int, int]]] | None = None,
        prompt_counts: list[int] | None = None,
    ) -> torch.Tensor:
        """hidden [T, hidden]: the sequences' tokens back to back, `seq_lens` each, sequence i
        in state slot `slots[i]` of this layer's conv_states [slots, ...] / ssm_states.
        `cuts[i]`: (offset, snapshot slot) pairs, the state after `offset` of sequence i's
        tokens copied into that slot (prefix snapshots at block boundaries).
        `prompt_counts[i]`: how many of sequence i's leading tokens are prompt tokens, the
        only ones whose dt is clamped (None: every token's)."""
        d = self.dims
        proj = F.linear(hidden, self.in_proj, self.in_proj_bias)
        gate, xbc, dt = proj.split([d.intermediate_size, d.conv_dim, d.num_heads], dim=-1)
        # dt's bias and softplus in the model's dtype, as transformers' layer computes them
        dt = F.softplus(dt + self.dt_bias).float()
        A = -torch.exp(self.A_log.float())
        y = torch.empty(
            hidden.shape[0], d.num_heads, d.head_dim, dtype=torch.float32, device=hidden.device
        )
        starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
        dt = self._limit(dt, starts, prompt_counts)
        steps = [i for i, n in enumerate(seq_lens) if n == 1]
        cuts = cuts or [[] for _ in seq_lens]
        states = (conv_states, ssm_states)
        for i, (start, n) in enumerate(zip(starts, seq_lens)):
            if n == 1:
                continue
            # a piece per snapshot: the scan resumes from the state the last piece left
            ends = [offset for offset, _ in cuts[i] if offset < n] + [n]
            for lo, hi in zip([0, *ends[:-1]], ends):
                self._scan(xbc, dt, A, slice(start + lo, start + hi), slots[i], states, y)
                _snapshot(states, slots[i], [slot for offset, slot in cuts[i] if offset == hi])
        if steps:
            y[[starts[i] for i in steps]] = self._step(
                xbc, dt, A, starts, slots, steps, conv_states, ssm_states
            )
            for i in steps:
                _snapshot(states, slots[i], [slot for _, slot in cuts[i]])
        return self._out(y.reshape(hidden.shape[0], -1), gate, hidden.dtype)

    def checkpoint_params(self) -> dict[str, tuple[torch.Tensor | None, object]]:
        """(parameter, transform) by checkpoint name after `mamba.` (None: no such weight)."""
        squeeze = _squeeze_channel  # conv1d.weight is [conv_dim, 1, K] in the checkpoint
        return {
            "in_proj.weight": (self.in_proj, None),
            "in_proj.bias": (self.in_proj_bias, None),
            "conv1d.weight": (self.conv_weight, squeeze),
            "conv1d.bias": (self.conv_bias, None),
            "dt_bias": (self.dt_bias, None),
            "A_log": (self.A_log, None),
            "D": (self.D, None),
            "norm.weight": (self.norm_weight, None),
            "out_proj.weight": (self.out_proj, None),
            "out_proj.bias": (self.out_proj_bias, None),
        }

    def _scan(self, xbc, dt, A, rows: slice, slot: int, states, y: torch.Tensor) -> None:
        """One prefill piece of a sequence from its slot's state, which it advances."""
        conv_states, ssm_states = states
        conv = causal_conv1d(xbc[rows], conv_states[slot], self.conv_weight, self.conv_bias)
        x, B, C = self._split(conv)
        if self._on_triton(x):
            from kvpager.kernels.mamba2_triton import ssm_scan_varlen

            bounds = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=x.device)
            index = torch.tensor([slot], device=x.device)
            y[rows] = ssm_scan_varlen(x, dt[rows], A, B, C, self.D, bounds, index, ssm_states)
            return
        y[rows] = ssm_scan_chunked(
            x, dt[rows], A, B, C, self.D, ssm_states[slot], self.dims.chunk_size
        )

    def _limit(self, dt: torch.Tensor, starts: list[int], prompt_counts) -> torch.Tensor:
        """dt clamped to time_step_limit on the prompt tokens alone: transformers (as
        mamba_ssm and vLLM) clamps in the chunked scan of a prompt, not in a decode step, so
        outputs (recomputed after a preemption too) stay unclamped."""
        low, high = self.dims.time_step_limit
        if low <= 0.0 and high == float("inf"):
            return dt  # softplus is positive: nothing to clamp
        if prompt_counts is None:
            return dt.clamp(low, high)
        rows = [r for start, n in zip(starts, prompt_counts) for r in range(start, start + n)]
        if rows:
            dt[rows] = dt[rows].clamp(low, high)
        return dt

    def _on_triton(self, x: torch.Tensor) -> bool:
        return bool(self.triton or (self.triton is None and x.is_cuda))

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dims
        groups = d.num_groups * d.state_size
        x, B, C = conv.split([d.intermediate_size, groups, groups], dim=-1)
        n = conv.shape[0]
        return (
            x.reshape(n, d.num_heads, d.head_dim),
            B.reshape(n, d.num_groups, d.state_size),
            C.reshape(n, d.num_groups, d.state_size),
        )

    def _step(self, xbc, dt, A, starts, slots, steps, conv_states, ssm_states) -> torch.Tensor:
        """Decode: every one-token sequence in one batched conv and scan step."""
        rows = [starts[i] for i in steps]
        seq_slots = torch.tensor([slots[i] for i in steps], device=xbc.device)
        if self._on_triton(xbc):
            return self._step_triton(xbc[rows], dt[rows], A, seq_slots, conv_states, ssm_states)
        window = torch.cat([conv_states[seq_slots], xbc[rows][:, :, None]], dim=-1)  # [S, C, K]
        conv_states[seq_slots] = window[:, :, 1:].to(conv_states.dtype)
        conv = (window.to(self.conv_weight.dtype) * self.conv_weight).sum(-1)
        if self.conv_bias is not None:
            conv = conv + self.conv_bias
        x, B, C = self._split(F.silu(conv).to(xbc.dtype))
        return ssm_step_cpu(x, dt[rows], A, B, C, self.D, ssm_states, seq_slots)

    def _step_triton(self, xbc, dt, A, seq_slots, conv_states, ssm_states) -> torch.Tensor:
        from kvpager.kernels.mamba2_triton import causal_conv1d_step_triton, ssm_step_slots

        conv = causal_conv1d_step_triton(
            xbc, conv_states, seq_slots, self.conv_weight, self.conv_bias
        )
        x, B, C = self._split(conv)
        return ssm_step_slots(x, dt, A, B, C, self.D, ssm_states, seq_slots)

    def _out(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gated RMSNorm (per group of channels) and out_proj."""
        d = self.dims
        y = y * F.silu(gate.float())
        grouped = y.view(y.shape[0], d.num_groups, -1)
        mean_square = self.shard.group_mean_square(grouped, self.group)
        grouped = grouped * torch.rsqrt(mean_square + d.eps)
        y = self.norm_weight * grouped.view_as(y)  # scaled in fp32, rounded once (as transformers)
        bias = self.out_proj_bias if self.adds_out_bias else None
        return F.linear(y.to(dtype), self.out_proj, bias)


def _snapshot(states: tuple[torch.Tensor, torch.Tensor], slot: int, copies: list[int]) -> None:
    """This layer's state of `slot` copied into each snapshot slot of `copies`."""
    for state in states:
        for copy in copies:
            state[copy] = state[slot]


def _squeeze_channel(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[:, 0]
