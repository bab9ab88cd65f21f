"""KV-cache sizing: bytes per token and sequence, and how many sequences a budget holds.

Contiguous serving reserves `max_tokens` slots per sequence up front; paging allocates blocks as
tokens arrive, so a sequence of average length L holds ceil(L / block_size) blocks and wastes
less than one block. Under tensor parallelism every rank holds its share of every sequence's KV
heads, so the sequences that fit are one rank's KV budget over one rank's bytes per sequence;
GPUs beyond one group make replicas, each with sequences of its own. A sliding-window layer
holds at most its window's blocks (plus the one being filled) however long the sequence: paged
sequences count that, contiguous reservations (no freeing) do not.
"""

import re
from dataclasses import dataclass

from kvpager.engine.model_config import ModelConfig, dtype_bytes

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '1.5e9' -> bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is not a size such as 80GiB or 80GB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def weight_bytes_per_rank(config: ModelConfig, dtype: object, size: int = 1) -> int:
    """Bytes of the weights one of `size` ranks holds (engine/model/sharding.py): 1/N of every
    sharded matrix (each routed expert's too), the vocab padded to a multiple of N, KV heads
    replicated past their count, the norms and routers whole; Gemma's and gpt-oss's norms in
    float32 (engine/model/decoder.py: norm_dtype), gpt-oss's sinks too, its biases beside."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_heads // size * head_dim, config.kv_heads_per_rank(size) * head_dim
    attention = (q + 2 * kv) * hidden + hidden * q + ((q + 2 * kv) if config.attention_bias else 0)
    if config.mla:
        attention = _mla_weights(config, size)
    matrices = 2 + config.gated_mlp  # gate, up, down (Nemotron-H's ungated MLPs: up, down)
    dense = matrices * hidden * (config.intermediate_size // size)
    expert_rows = config.moe_intermediate_size // size
    experts = config.num_experts * (matrices * hidden * expert_rows + hidden)
    if config.gpt_oss_experts:  # router, gate_up and down biases
        experts += config.num_experts * (1 + 2 * expert_rows + hidden)
    attention += hidden if config.o_proj_bias else 0
    shared = config.shared_expert_intermediate_size // size  # Llama 4's, DeepSeek's
    experts += matrices * hidden * shared
    mixer = _mamba2_weights(config, size) if config.mamba_dims else 0
    if config.deltanet_dims is not None:  # Qwen3-Next: its q_proj's gate rows too
        mixer = config.deltanet_dims.per_rank(size).weight_elements()
        attention += q * (hidden + config.attention_bias)
    experts += hidden if config.shared_expert_gate else 0  # one gate row a MoE layer
    layers = sum(  # Nemotron-H's layers have one of the two blocks
        config.has_mixer(i) * (mixer if config.is_recurrent(i) else attention)
        + config.has_mlp(i) * (experts if config.is_sparse(i) else dense)
        for i in range(config.num_layers)
    )
    vocab = -(-config.vocab_size // size) * hidden
    embeddings = vocab * (1 if config.tie_word_embeddings else 2)
    qk_norms = 2 * head_dim if config.qk_norm else 0
    block_norms = (2 if config.gemma_norms else 1) * hidden  # a norm (Gemma: 2) a block
    blocks = sum(config.has_mixer(i) + config.has_mlp(i) for i in range(config.num_layers))
    # the final norm too; recurrent layers have no q/k norms
    norms = blocks * block_norms + hidden
    norms += (config.num_layers - config.num_recurrent_layers) * qk_norms
    element = dtype_bytes(dtype)
    float32_norms = config.gemma_norms or config.float32_norms or config.zero_centred_norms
    norm_element = dtype_bytes("float32") if float32_norms else element
    sinks = config.num_layers * config.num_heads // size if config.attention_sinks else 0
    if config.moe_router in ("deepseek", "deepseek_v2"):  # fp32 routers (V3: and biases)
        moe_layers = sum(config.sparse_layers)
        layers -= moe_layers * config.num_experts * hidden
        bias = 1 if config.moe_router == "deepseek" else 0
        sinks += moe_layers * config.num_experts * (hidden + bias)
    return (layers + embeddings) * element + norms * norm_element + sinks * dtype_bytes("float32")


def _mamba2_weights(config: ModelConfig, size: int) -> int:
    """Elements of a Mamba2 mixer (engine/model/mamba2.py) on one of `size` ranks (its heads,
    its groups or the one it reads: engine/model/sharding.py, Mamba2Shard) in place of
    attention."""
    d, hidden = config.mamba_dims.per_rank(size), config.hidden_size
    inner, conv = d.intermediate_size, d.conv_dim
    proj = inner + conv + d.num_heads
    bias = (proj + hidden) if config.mamba_proj_bias else 0
    conv_bias = conv if config.mamba_conv_bias else 0
    return (
        proj * hidden
        + conv * d.conv_kernel
        + conv_bias
        + 3 * d.num_heads
        + inner * (1 + hidden)
        + bias
    )


def _mla_weights(config: ModelConfig, size: int) -> int:
    """Elements of a latent-attention layer on one of `size` ranks (engine/model/mla.py: the
    heads split, the latent's projections whole), its norms too."""
    hidden, heads, latent = config.hidden_size, config.num_heads // size, config.kv_lora_rank
    q_rows = heads * (config.qk_nope_head_dim + config.head_dim)
    q_rank = config.q_lora_rank
    q = q_rank * hidden + q_rank + q_rows * q_rank if q_rank else q_rows * hidden
    kv = (latent + config.head_dim) * hidden + latent
    if config.attention_bias:  # q_a_proj's and kv_a_proj_with_mqa's (o_proj's: o_proj_bias)
        q, kv = q + q_rank, kv + latent + config.head_dim
    return (
        q
        + kv
        + heads * (config.qk_nope_head_dim + config.v_head_dim) * latent
        + (hidden * heads * config.v_head_dim)
    )


def gpu_kv_budget(
    config: ModelConfig, weight_dtype: object, gpu_bytes: int, utilization: float, size: int
) -> int:
    """KV bytes on one GPU of a group of `size`: its usable memory less its weights."""
    return int(gpu_bytes * utilization) - weight_bytes_per_rank(config, weight_dtype, size)


@dataclass(frozen=True)
class KvSizeReport:
    bytes_per_token: int  # on one rank
    bytes_per_sequence: int  # at max_tokens, on one rank
    total_bytes: int  # users x bytes_per_sequence x ranks
    budget_bytes: int  # on one rank
    contiguous_sequences: int  # fit when each reserves max_tokens
    paged_sequences: int  # fit when each holds blocks for avg_tokens
    paged_utilisation: float  # stored tokens / allocated slots under paging
    users: int
    dtype: str = ""  # the KV cache's, by name
    tensor_parallel_size: int = 1
    replicas: int = 1  # groups of tensor_parallel_size GPUs, each serving its own sequences
    # at max_tokens, paged, sliding layers capped at their window, chunked ones (Llama 4) at
    # their chunk; None: no sliding or chunked layers
    windowed_bytes_per_sequence: int | None = None

    def _window_lines(self, per: str) -> list[str]:
        if self.windowed_bytes_per_sequence is None:
            return []
        windowed, gib = self.windowed_bytes_per_sequence, 1024**3
        share = windowed / self.bytes_per_sequence
        return [
            f"  paged, windows freeing:  {windowed:,}{per} ({windowed / gib:.2f} GiB, "
            f"{share:.0%}: sliding layers hold only their window's blocks, chunked layers "
            "their chunk's)"
        ]

    def lines(self) -> list[str]:
        gib, ranks, replicas = 1024**3, self.tensor_parallel_size, self.replicas
        per = " per rank" if ranks > 1 else ""
        fits = self.paged_sequences * replicas
        lines = [
            f"KV bytes per token:        {self.bytes_per_token:,}{per}"
            + (f" ({self.dtype})" if self.dtype else ""),
            f"KV bytes per sequence:     {self.bytes_per_sequence:,}{per} "
            f"({self.bytes_per_sequence / gib:.2f} GiB)",
            f"KV bytes for all users:    {self.total_bytes:,} ({self.total_bytes / gib:.2f} GiB)",
            *self._window_lines(per),
            f"budget:                    {self.budget_bytes:,}{per} "
            f"({self.budget_bytes / gib:.2f} GiB)",
            f"sequences that fit, contiguous max-length reservation: "
            f"{self.contiguous_sequences * replicas}",
            f"sequences that fit, paged at the average length:       {fits} "
            f"(slot utilisation {self.paged_utilisation:.1%})",
        ]
        if replicas > 1:
            lines.append(f"({replicas} replicas of {ranks} ranks; the counts are their sum)")
        verdict = "fit" if fits >= self.users else "do not fit"
        return lines + [f"{self.users} users {verdict} paged at the average length"]


def kv_size(
    config: ModelConfig,
    dtype: object,
    max_tokens: int,
    users: int,
    budget_bytes: int,
    avg_tokens: int,
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    replicas: int = 1,
) -> KvSizeReport:
    """`budget_bytes`: the KV memory of one rank (all of it without tensor parallelism)."""
    per_token = config.kv_bytes_per_token(dtype, tensor_parallel_size)
    blocks_per_avg = -(-avg_tokens // block_size)
    budget = max(0, budget_bytes)
    paged_avg = paged_bytes_per_sequence(
        config, dtype, avg_tokens, block_size, tensor_parallel_size
    )
    windowed = None
    if any(config.layer_windows):
        windowed = paged_bytes_per_sequence(
            config, dtype, max_tokens, block_size, tensor_parallel_size
        )
    return KvSizeReport(
        bytes_per_token=per_token,
        bytes_per_sequence=per_token * max_tokens,
        total_bytes=per_token * max_tokens * users * tensor_parallel_size,
        budget_bytes=budget_bytes,
        contiguous_sequences=budget // (per_token * max_tokens),
        paged_sequences=budget // paged_avg,
        paged_utilisation=avg_tokens / (blocks_per_avg * block_size),
        users=users,
        dtype=str(dtype).removeprefix("torch."),
        tensor_parallel_size=tensor_parallel_size,
        replicas=replicas,
        windowed_bytes_per_sequence=windowed,
    )


def paged_bytes_per_sequence(
    config: ModelConfig, dtype: object, num_tokens: int, block_size: int, size: int = 1
) -> int:
    """KV bytes one paged sequence of `num_tokens` holds on one rank while it decodes: a full
    layer every block, a sliding layer at most ceil((window - 1) / block_size) + 1, a chunked
    one its chunk's ceil(C / block_size)."""
    per_layer_slot = config.kv_bytes_per_token(dtype, size) // config.num_layers
    blocks = -(-num_tokens // block_size)
    windows = config.layer_windows or (0,) * config.num_layers
    held = sum(min(blocks, _blocks_held(w, block_size)) if w else blocks for w in windows)
    return held * block_size * per_layer_slot


def _blocks_held(window: int, block_size: int) -> int:
    """Blocks a decoding sequence holds in a layer of this sliding window or chunk (-C)."""
    if window < 0:
        return -(window // block_size)  # ceil(C / block_size)
    return -(-(window - 1) // block_size) + 1
