"""What one tensor-parallel rank holds of a model, and which rows or columns of each checkpoint
tensor that is (Megatron-style sharding, as vLLM and SGLang do it).

    q/k/v, gate/up   column-parallel: the rank's heads / MLP rows  -> no communication
    o, down          row-parallel: the matching input columns      -> all-reduce after
    embed, lm_head   vocab-parallel: rows [rank * V_r, (rank + 1) * V_r) of the vocab padded
                     to N * V_r; the embedding is all-reduced, the logits all-gathered

KV heads split across the ranks; when the ranks outnumber them, rank r holds the one head its
query heads use (head r // (N / num_kv_heads)), replicated on N / num_kv_heads ranks.
"""

from dataclasses import dataclass

from engine.config import ModelConfig

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
        """The part of a per-layer checkpoint tensor (name after `layers.<i>.`) this rank reads."""
        if not self.is_sharded or "norm" in name:
            return None
        head_dim, kind = self.head_dim, name.rsplit(".", 2)[-2]
        q_start, kv_start = self.rank * self.q_size, self.first_kv_head * head_dim
        mlp_start = self.rank * self.intermediate_size
        parts = {
            "q_proj": (0, q_start, q_start + self.q_size),
            "k_proj": (0, kv_start, kv_start + self.kv_size),
            "v_proj": (0, kv_start, kv_start + self.kv_size),
            "o_proj": (1, q_start, q_start + self.q_size),
            "gate_proj": (0, mlp_start, mlp_start + self.intermediate_size),
            "up_proj": (0, mlp_start, mlp_start + self.intermediate_size),
            "down_proj": (1, mlp_start, mlp_start + self.intermediate_size),
        }
        return parts[kind]
