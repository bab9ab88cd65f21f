"""What one tensor-parallel rank holds of a model, and which rows or columns of each checkpoint
tensor that is (Megatron-style sharding, as vLLM and SGLang do it).

    q/k/v, gate/up   column-parallel: the rank's heads / MLP rows  -> no communication
    o, down          row-parallel: the matching input columns      -> all-reduce after
    embed, lm_head   vocab-parallel: rows [rank * V_r, (rank + 1) * V_r) of the vocab padded
                     to N * V_r; the embedding is all-reduced, the logits all-gathered

KV heads split across the ranks; when the ranks outnumber them, rank r holds the one head its
query heads use (head r // (N / num_kv_heads)), replicated on N / num_kv_heads ranks. Routed
experts shard like the dense MLP, each expert's intermediate dimension split over the ranks
(the router is replicated); DeepSeek's shared experts like the dense MLP, and its latent
attention by heads (engine/model/mla.py: the latent is every head's, so each rank keeps it).
Fused checkpoint tensors (Phi-3's qkv_proj, gate_up_proj) are read as their q, k, v (gate,
up) row ranges, so a rank still reads only its rows. Mamba2 mixers split by SSM heads
(Mamba2Shard, below).
"""

from dataclasses import dataclass

import torch
from kvpager.engine.mamba2_config import Mamba2Dims
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.parallel.group import TensorParallel

# (dim, start, stop): the part of a checkpoint tensor a rank reads; None: all of it
Part = tuple[int, int, int] | None


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world_size`: its head, MLP and vocab counts (the whole model at 1)."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_per_rank: int  # rows of the padded vocab this rank holds
    head_dim: int
    first_kv_head: int
    total_kv_heads: int = 0  # the model's, for the row ranges inside a fused qkv_proj
    expert_intermediate_size: int = 0  # each routed expert's rows on this rank
    shared_expert_intermediate_size: int = 0  # DeepSeek's shared experts' rows on this rank

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, world_size: int = 1) -> "Shard":
        """Raises ConfigError when the model does not split over `world_size` ranks."""
        assert 0 <= rank < world_size, f"rank {rank} of {world_size}"
        config.check_tensor_parallel(world_size)
        num_kv_heads = config.kv_heads_per_rank(world_size)
        replicas = max(1, world_size // config.num_kv_heads)
        return cls(
            rank=rank,
            world_size=world_size,
            num_heads=config.num_heads // world_size,
            num_kv_heads=num_kv_heads,
            intermediate_size=config.intermediate_size // world_size,
            vocab_per_rank=-(-config.vocab_size // world_size),
            head_dim=config.head_dim,
            first_kv_head=rank // replicas * num_kv_heads,
            total_kv_heads=config.num_kv_heads,
            expert_intermediate_size=config.moe_intermediate_size // world_size,
            shared_expert_intermediate_size=config.shared_expert_intermediate_size // world_size,
        )

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def vocab_part(self, vocab_size: int) -> Part:
        """Rows of the embedding / lm_head; the last rank's may stop short (padding)."""
        start = min(self.vocab_start, vocab_size)
        return (0, start, min(start + self.vocab_per_rank, vocab_size))

    def layer_part(self, name: str) -> Part:
        """The part of a per-layer checkpoint tensor (name after `layers.<i>.`) this rank reads:
        None for norms and the (replicated) router."""
        kind = name.rsplit(".", 2)[-2]
        if not self.is_sharded or "norm" in name or kind == "gate":
            return None
        width = self.expert_intermediate_size if ".experts." in name else self.intermediate_size
        if ".shared_experts." in name:  # DeepSeek's, beside the routed ones
            width = self.shared_expert_intermediate_size
        mlp_start = self.rank * width
        q_start, kv_start = self.rank * self.q_size, self.first_kv_head * self.head_dim
        parts = {
            "q_proj": (0, q_start, q_start + self.q_size),
            "k_proj": (0, kv_start, kv_start + self.kv_size),
            "v_proj": (0, kv_start, kv_start + self.kv_size),
            "o_proj": (1, q_start, q_start + self.q_size),
            "gate_proj": (0, mlp_start, mlp_start + width),
            "up_proj": (0, mlp_start, mlp_start + width),
            "down_proj": (1, mlp_start, mlp_start + width),
        }
        return parts[MIXTRAL_NAMES.get(kind, kind)]

    def rows_of_heads(self, dim: int, per_head: int) -> Part:
        """The rank's span of `dim` in a tensor of `per_head` entries a query head, heads
        in order (MLA's q_b_proj and kv_b_proj rows, o_proj's columns); None: one rank."""
        if not self.is_sharded:
            return None
        width = self.num_heads * per_head
        return (dim, self.rank * width, (self.rank + 1) * width)

    def head_part(self) -> Part:
        """The rank's rows of a per-query-head tensor (gpt-oss's sinks)."""
        return self.rows_of_heads(0, 1)

    def expert_part(self, dim: int | None, columns: int) -> Part:
        """The rank's span of a stacked expert tensor's intermediate `dim` (None: replicated),
        `columns` entries per intermediate row (gpt-oss's interleaved gate_up: 2)."""
        if not self.is_sharded or dim is None:
            return None
        width = columns * self.expert_intermediate_size
        return (dim, self.rank * width, (self.rank + 1) * width)

    def fused_part(self, kind: str, index: int) -> Part:
        """This rank's rows of q, k or v (index 0-2) in a fused qkv_proj, or of gate or up
        (0-1) in a fused gate_up_proj."""
        if kind == "gate_up_proj":
            total = self.intermediate_size * self.world_size
            start = index * total + self.rank * self.intermediate_size
            return (0, start, start + self.intermediate_size)
        q_total, kv_total = self.q_size * self.world_size, self.total_kv_heads * self.head_dim
        if index == 0:
            return (0, self.rank * self.q_size, (self.rank + 1) * self.q_size)
        start = q_total + (index - 1) * kv_total + self.first_kv_head * self.head_dim
        return (0, start, start + self.kv_size)


# Mixtral's expert weights: w1 gate, w3 up, w2 down
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# What one tensor-parallel rank holds of a Mamba2 mixer (engine/model/mamba2.py), split by
# SSM heads as vLLM's MambaMixer2 splits it:
#
#     in_proj      column-parallel, piece by piece: the rank's rows of z, x, B, C and dt
#     conv1d       the rank's channels of x, B and C (weight and bias)
#     A, D, dt     the rank's heads
#     norm         the rank's channels of the gated RMSNorm
#     out_proj     row-parallel: the rank's input columns -> all-reduce after (the decoder's)
#
# B and C (and their conv channels) are per group: a rank holds num_groups / N of them, or, when
# the ranks outnumber the groups, the one group its heads read (replicated on N / num_groups
# ranks). A norm group is then wider than a rank's channels: its sum of squares is summed over
# the ranks that share it (group_mean_square). Each rank's state slots hold only its heads'
# state (Mamba2Dims.per_rank), so a slot is 1/N of the model's.


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
