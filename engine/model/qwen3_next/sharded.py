"""What one tensor-parallel rank reads of Qwen3-Next's pieces (engine/model/sharding.py does
the other families' layers):

    gated DeltaNet   split by key heads and their value heads: in_proj_qkvz / in_proj_ba rows
                     (the checkpoint groups them per key head, so a rank's are one span), its
                     q, k and v channels of conv1d, its value heads' dt_bias and A_log,
                     out_proj's columns; the gated norm's weight (one value head's) whole
    gated attention  its heads' q|gate rows of q_proj, its KV heads' k / v rows (replicated
                     past their count), o_proj's columns; the q / k norms whole
    shared-expert    each expert's and the shared expert's intermediate rows (down's columns);
    MoE              the router and shared_expert_gate whole

Each piece is built at the rank's sizes; its `load_tensor` takes the rank's part, read as the
spans below and joined along their dim. Every row-parallel output (out_proj, o_proj, down) is
all-reduced by the decoder.
"""

from kvpager.engine.model.qwen3_next.gated_attention import GatedAttention
from kvpager.engine.model.qwen3_next.gated_deltanet import GatedDeltaNet
from kvpager.engine.model.sharding import Part, Shard
from torch import nn


def piece_parts(piece: nn.Module, name: str, shard: Shard) -> list[Part]:
    """The spans of checkpoint tensor `name` (after its piece's prefix) the rank reads, joined
    along their dim; [None]: all of it."""
    if not shard.is_sharded:
        return [None]
    if isinstance(piece, GatedDeltaNet):
        return _deltanet(piece, name, shard)
    if isinstance(piece, GatedAttention):
        return _attention(name, shard)
    return _moe(name, shard)


def _span(dim: int, start: int, width: int, rank: int) -> Part:
    return (dim, start + rank * width, start + (rank + 1) * width)


def _deltanet(mixer: GatedDeltaNet, name: str, shard: Shard) -> list[Part]:
    d, r = mixer.dims, shard.rank  # the rank's dims
    per_key = d.num_value_heads // d.num_key_heads
    if name == "in_proj_qkvz.weight":
        return [_span(0, 0, d.num_key_heads * (2 * d.key_head_dim + 2 * per_key *
                                               d.value_head_dim), r)]  # fmt: skip
    if name == "in_proj_ba.weight":
        return [_span(0, 0, d.num_key_heads * 2 * per_key, r)]
    if name == "conv1d.weight":
        key_dim = d.key_dim * shard.world_size
        return [_span(0, 0, d.key_dim, r), _span(0, key_dim, d.key_dim, r),
                _span(0, 2 * key_dim, d.value_dim, r)]  # fmt: skip
    if name in ("dt_bias", "A_log"):
        return [_span(0, 0, d.num_value_heads, r)]
    if name == "out_proj.weight":
        return [_span(1, 0, d.value_dim, r)]
    return [None]  # the gated norm's weight; another name: load_tensor says it is not ours


def _attention(name: str, shard: Shard) -> list[Part]:
    module = name.rsplit(".", 1)[0]
    kv_start = shard.first_kv_head * shard.head_dim
    spans = {
        "q_proj": _span(0, 0, 2 * shard.q_size, shard.rank),  # per head [q | gate]
        "k_proj": (0, kv_start, kv_start + shard.kv_size),
        "v_proj": (0, kv_start, kv_start + shard.kv_size),
    }
    if module == "o_proj":
        return [_span(1, 0, shard.q_size, shard.rank) if name.endswith("weight") else None]
    return [spans.get(module)]  # the norms whole


def _moe(name: str, shard: Shard) -> list[Part]:
    parts = name.split(".")
    width, r = shard.expert_intermediate_size, shard.rank
    if parts[0] == "shared_expert":
        width = shard.shared_expert_intermediate_size
    kind = parts[-2] if parts[-1] == "weight" else parts[-1]
    if kind in ("gate_proj", "up_proj"):
        return [_span(0, 0, width, r)]
    if kind == "down_proj" and parts[-1] == "weight":
        return [_span(1, 0, width, r)]
    if name == "experts.gate_up_proj":  # stacked [E, 2I, H]: gate rows, then up
        total = width * shard.world_size
        return [_span(1, 0, width, r), _span(1, total, width, r)]
    if name == "experts.down_proj":  # stacked [E, H, I]
        return [_span(2, 0, width, r)]
    return [None]  # the router, shared_expert_gate
