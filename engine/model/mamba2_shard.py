"""What one tensor-parallel rank holds of a Mamba2 mixer (engine/model/mamba2.py), split by
SSM heads as vLLM's MambaMixer2 splits it:

    in_proj      column-parallel, piece by piece: the rank's rows of z, x, B, C and dt
    conv1d       the rank's channels of x, B and C (weight and bias)
    A, D, dt     the rank's heads
    norm         the rank's channels of the gated RMSNorm
    out_proj     row-parallel: the rank's input columns -> all-reduce after (the decoder's)

B and C (and their conv channels) are per group: a rank holds num_groups / N of them, or, when
the ranks outnumber the groups, the one group its heads read (replicated on N / num_groups
ranks). A norm group is then wider than a rank's channels: its sum of squares is summed over
the ranks that share it (group_mean_square). Each rank's state slots hold only its heads'
state (Mamba2Dims.per_rank), so a slot is 1/N of the model's.
"""

from dataclasses import dataclass

import torch
from kvpager.engine.mamba2_config import Mamba2Dims
from kvpager.engine.model.sharding import Part
from kvpager.engine.parallel.group import TensorParallel


@dataclass(frozen=True)
class Mamba2Shard:
    """Rank `rank` of `world_size` of a mixer whose whole geometry is `model`."""

    model: Mamba2Dims
    rank: int = 0
    world_size: int = 1

    @property
    def dims(self) -> Mamba2Dims:
        """The rank's mixer (the model's at one rank)."""
        return self.model.per_rank(self.world_size)

    @property
    def norm_span(self) -> int:
        """Ranks a norm group spans: 1 unless the ranks outnumber the groups."""
        return max(1, self.world_size // self.model.num_groups)

    def parts(self, name: str) -> list[tuple[int, Part]]:
        """(row offset in the rank's parameter, part of the checkpoint tensor) for a mixer
        tensor's name after `mamba.`; [(0, None)]: read whole (one rank, out_proj's bias)."""
        if self.world_size == 1 or name == "out_proj.bias":
            return [(0, None)]
        d, m = self.dims, self.model
        heads, inner = self._span(d.num_heads), self._span(d.intermediate_size)
        if name in ("in_proj.weight", "in_proj.bias"):
            return self._xbc(m.intermediate_size, d.intermediate_size, inner) + [
                (0, (0, *inner)),  # z, ahead of x|B|C in the checkpoint, dt after them
                (d.intermediate_size + d.conv_dim, (0, *self._after(m.intermediate_size +
                                                                     m.conv_dim, heads))),
            ]  # fmt: skip
        if name in ("conv1d.weight", "conv1d.bias"):
            return self._xbc(0, 0, inner)
        if name in ("dt_bias", "A_log", "D"):
            return [(0, (0, *heads))]
        if name == "norm.weight":
            return [(0, (0, *inner))]
        assert name == "out_proj.weight", name
        return [(0, (1, *inner))]

    def _span(self, per_rank: int) -> tuple[int, int]:
        return self.rank * per_rank, (self.rank + 1) * per_rank

    @staticmethod
    def _after(start: int, span: tuple[int, int]) -> tuple[int, int]:
        return start + span[0], start + span[1]

    def _xbc(self, source: int, dest: int, inner: tuple[int, int]) -> list[tuple[int, Part]]:
        """x, B and C: the rank's x channels, then its groups' B and C rows, from `source` in
        the checkpoint tensor to `dest` in the rank's parameter."""
        d, m = self.dims, self.model
        group_rows = m.num_groups * m.state_size
        first = m.first_group(self.rank, self.world_size) * m.state_size
        rows = (first, first + d.num_groups * d.state_size)
        b_source, b_dest = source + m.intermediate_size, dest + d.intermediate_size
        c_dest = b_dest + d.num_groups * d.state_size
        return [
            (dest, (0, *self._after(source, inner))),
            (b_dest, (0, *self._after(b_source, rows))),
            (c_dest, (0, *self._after(b_source + group_rows, rows))),
        ]

    def group_mean_square(
        self, grouped: torch.Tensor, group: TensorParallel | None
    ) -> torch.Tensor:
        """The gated norm's mean square of `grouped` [T, groups, channels]: per local group,
        or over the ranks that share the group when the ranks outnumber the groups."""
        if self.norm_span == 1 or group is None:
            return grouped.pow(2).mean(-1, keepdim=True)
        sums = grouped.new_zeros(grouped.shape[0], self.world_size)
        sums[:, self.rank] = grouped.pow(2).sum((-2, -1))  # one local group
        group.all_reduce(sums)
        first = self.rank // self.norm_span * self.norm_span
        total = sums[:, first : first + self.norm_span].sum(-1)
        width = self.model.intermediate_size // self.model.num_groups
        return (total / width)[:, None, None]
