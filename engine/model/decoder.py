"""One decoder for every supported family; they differ only by config switches
(engine/model_families.py): q/k norms, Gemma's sandwich norms and GeGLU, a window and a
soft-cap per layer, a second RoPE table for sliding layers, routed experts for MoE layers;
Llama 4's NoPE layers (no rotary, a temperature on q), its weightless q/k norm after RoPE and
its shared expert beside the routed ones (engine/llama4_family.py); DeepSeek V3's latent
attention (engine/model/mla.py) in place of q|k|v and o, its grouped router
(engine/model/deepseek_router.py); Qwen3-Next's gated attention and gated shared-expert MoE
(engine/model/qwen3_next/layer_pieces.py); Nemotron-H's layers of one block each, attention
or Mamba2 (the first) or a relu2 MLP or MoE (the second) (engine/families/nemotron_h.py).

Weights are fused at load time (q|k|v and gate|up), so each layer runs four matmuls. Under
tensor parallelism each rank holds its Shard (engine/model/sharding.py) and the decoder adds
the collectives: all-reduces after o, down and the embedding, an all-gather of the logits.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from kvpager.engine.kv.kv_groups import kv_groups
from kvpager.engine.model.attention import AttentionMetadata, PagedAttention
from kvpager.engine.model.linear import build_matmul, make_linear, param_makers, release
from kvpager.engine.model.mla import MlaAttention
from kvpager.engine.model.moe import RoutedExperts
from kvpager.engine.model.qwen3_next.layer_pieces import build_pieces
from kvpager.engine.model.recurrent import RecurrentBatch, mixer_kind, state_indices
from kvpager.engine.model.rope import cos_sin_table, longrope_original_length
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.parallel.group import TensorParallel
from kvpager.kernels.backend import KernelOps
from torch import nn

# Long float32 batches (prefill) run the MLP in 512-row chunks, whose activation stays in cache
# (rows are the same either way); bf16 runs whole, faster on an AMX host
# (benchmarks/reports/2026-12-03-saturated-step-profile/).
MLP_CHUNK_TOKENS = 512


def norm_dtype(config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The norm weights' dtype: the model's, but float32 for Gemma's and Qwen3-Next's (1 + w)
    scales: they scale in fp32 and round once (`(norm(x) * (1 + w)).to(dtype)`, not Llama's
    `w * norm(x).to(dtype)`), as the norm ops apply a float32 weight (kernels/reference.py:
    rms_norm_ref); gpt-oss keeps its norm weights in fp32 and scales the same way."""
    float32 = config.gemma_norms or config.float32_norms or config.zero_centred_norms
    return torch.float32 if float32 else dtype


# ungated MLPs (Nemotron-H's: relu2, or what `mlp_hidden_act` names) act on the up rows alone
UNGATED = {
    "relu2": lambda x: torch.square(F.relu(x)),
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(config: ModelConfig, ops: KernelOps):
    if not config.gated_mlp:
        return UNGATED[config.hidden_act]
    gelus = {"gelu_pytorch_tanh": ops.gelu_tanh_and_mul, "gelu": ops.gelu_and_mul}
    return gelus.get(config.hidden_act, ops.silu_and_mul)


def _all_reduce(group: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    return x if group is None else group.all_reduce(x)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        dtype: torch.dtype,
        ops: KernelOps,
        shard: Shard,
        group: TensorParallel | None,
    ) -> None:
        super().__init__()
        self.ops = ops  # norm, rotary and activation kernels of the executor's backend
        self.group, self.shard = group, shard
        hidden, intermediate = config.hidden_size, shard.intermediate_size
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.window = config.window(layer_idx)
        self.softcap = config.attn_logit_softcapping or 0.0
        self.k_scale = self.v_scale = 1.0  # an fp8 cache's: the loader sets them (kv_scales.py)
        self.local_rope = self.window > 0 and config.local_rope_theta is not None
        self.rope = config.uses_rope(layer_idx)
        # Llama 4: a NoPE layer's q takes the position's temperature; a RoPE layer's q and k
        # a weightless norm after the rotation (a weight of ones)
        self.temperature = not self.rope and config.attn_temperature is not None
        if config.qk_l2_norm and self.rope:
            self.register_buffer("unit_norm", torch.ones(self.head_dim, dtype=dtype), False)
        else:
            self.unit_norm = None
        self.activation = _activation(config, ops)

        self.residual_multiplier = config.residual_multiplier  # Granite's; 1 elsewhere
        self._attention_params(config, layer_idx, dtype, hidden)
        self._mlp_params(config, layer_idx, dtype, shard, hidden, intermediate)
        self.build_matmuls(pack=False)

    def _attention_params(
        self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, hidden: int
    ) -> None:
        norm = norm_dtype(config, dtype)
        param, optional = param_makers(dtype)
        # Nemotron-H's layers have one of the two blocks (config.layer_blocks)
        has_mixer, has_mlp = config.has_mixer(layer_idx), config.has_mlp(layer_idx)
        self.input_norm = optional(has_mixer, hidden, dtype=norm)
        # DeepSeek's latent attention (engine/model/mla.py) instead of q|k|v and o
        self.mla = MlaAttention(config, dtype, norm, self.shard) if config.mla else None
        # a recurrent layer's mixer (engine/model/recurrent.py) instead of attention
        self.mixer, self.run_mixer = None, None
        if config.is_recurrent(layer_idx):
            kind = mixer_kind(config)
            self.mixer, self.run_mixer = kind.build(config, dtype, self.shard, self.group), kind.run
        self.gated_attn, self.moe_block = build_pieces(config, layer_idx, dtype, self.shard)
        regular = has_mixer and self.mla is None and self.mixer is None and self.gated_attn is None
        self.qkv_weight = optional(regular, self.q_size + 2 * self.kv_size, hidden)
        self.qkv_bias = optional(regular and config.attention_bias, self.q_size + 2 * self.kv_size)
        self.q_norm = optional(config.qk_norm and regular, self.head_dim, dtype=norm)  # all heads
        self.k_norm = optional(config.qk_norm and regular, self.head_dim, dtype=norm)
        self.o_weight = optional(regular, hidden, self.q_size)
        # gpt-oss: o's bias (added once, after the all-reduce) and a sink logit per head
        self.o_bias = optional(config.o_proj_bias, hidden)
        self.sinks = optional(config.attention_sinks, self.num_heads, dtype=torch.float32)
        # Gemma's sandwich norms: on the attention output and the MLP output, before the adds
        self.attn_output_norm = optional(config.gemma_norms, hidden, dtype=norm)
        self.post_attention_norm = optional(has_mlp, hidden, dtype=norm)  # the MLP's input norm
        self.mlp_output_norm = optional(config.gemma_norms, hidden, dtype=norm)

    def _mlp_params(
        self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, shard: Shard, hidden: int,
        intermediate: int,
    ) -> None:  # fmt: skip
        param, _ = param_makers(dtype)
        self.experts = None
        if config.is_sparse(layer_idx) and self.moe_block is None:
            self.experts = RoutedExperts(
                config, shard.expert_intermediate_size, dtype, add_down_bias=shard.rank == 0
            )
            # 0: none; DeepSeek's split over the ranks (Llama 4's: one rank only)
            intermediate = shard.shared_expert_intermediate_size
        # the dense MLP, or a MoE layer's shared expert (Llama 4)
        intermediate = intermediate if config.has_mlp(layer_idx) else 0
        self.has_mlp = intermediate > 0 and self.moe_block is None
        if self.has_mlp:  # gate rows, then up rows (Nemotron-H's: up rows alone)
            self.gate_up_weight = param((1 + config.gated_mlp) * intermediate, hidden)
            self.down_weight = param(hidden, intermediate)

    def build_matmuls(self, pack: bool) -> None:
        """The four matmuls (a MoE layer: attention's two, and its experts'); once packed, the
        plain weights are released (they are copies)."""
        if self.mla is not None:
            self.mla.build_matmuls(pack)
        elif self.qkv_weight is not None:
            self.qkv = build_matmul(self.qkv_weight, self.qkv_bias, pack)
            self.o_proj = build_matmul(self.o_weight, None, pack)
        if self.has_mlp:
            self.gate_up = build_matmul(self.gate_up_weight, None, pack)
            self.down = build_matmul(self.down_weight, None, pack)
        if self.experts is not None:
            self.experts.build_matmuls(pack and self.ops.pack_experts)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: "RopeRows",
        attention: PagedAttention,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + delta (delta None at the first layer); returns the next
        layer's (x, delta), so each residual add is fused into the norm that follows it. A
        recurrent layer's `layer_cache` is its RecurrentLayerCache (engine/model/recurrent.py)."""
        if self.input_norm is not None:  # every layer's, but Nemotron-H's MLP layers
            x, delta = self._mixer_block(x, delta, rope, attention, layer_cache, meta)
        if self.post_attention_norm is None:  # Nemotron-H's attention and Mamba layers
            return x, delta
        h, x = self.ops.add_rms_norm(x, delta, self.post_attention_norm, self.eps)
        if h.shape[0] <= MLP_CHUNK_TOKENS or h.dtype != torch.float32:
            mlp = self._mlp(h, self.ops)
        else:
            mlp = torch.cat([self._mlp(part, self.ops) for part in h.split(MLP_CHUNK_TOKENS)])
        return x, self._scaled(self._norm(_all_reduce(self.group, mlp), self.mlp_output_norm))

    def _mixer_block(self, x, delta, rope: "RopeRows", attention, layer_cache, meta):
        """The first block: (the residual, the mixer's branch to add to it)."""
        ops = self.ops
        h, x = ops.add_rms_norm(x, delta, self.input_norm, self.eps)
        if self.mla is not None:
            attn = self.mla(h, rope.full, layer_cache, meta, ops, attention.scale,
                            (self.k_scale, self.v_scale))  # fmt: skip
        elif self.mixer is not None:
            attn = self.run_mixer(self.mixer, h, layer_cache)
        elif self.gated_attn is not None:
            attn = self.gated_attn(h, *rope.full, attention, layer_cache, meta, ops)
        else:
            attn = self._attention(h, rope, attention, layer_cache, meta)
        attn = _all_reduce(self.group, attn)  # each branch's out / o_proj: this rank's heads'
        if self.o_bias is not None:
            attn = attn + self.o_bias
        return x, self._scaled(self._norm(attn, self.attn_output_norm))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch's output before its residual add: times Granite's residual_multiplier."""
        m = self.residual_multiplier
        return branch if m == 1.0 else branch * m

    def _attention(self, h, rope: "RopeRows", attention, layer_cache, meta) -> torch.Tensor:
        """q|k|v, norms and RoPE, paged attention, o (this rank's part: [T, hidden])."""
        ops, num_tokens = self.ops, h.shape[0]
        q, k, v = self.qkv(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._head_norm(q.view(num_tokens, self.num_heads, self.head_dim), self.q_norm)
        k = self._head_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim), self.k_norm)
        if self.rope:
            q, k = ops.rotary(q, k, *(rope.local if self.local_rope else rope.full))
        if self.unit_norm is not None:
            q, k = self._head_norm(q, self.unit_norm), self._head_norm(k, self.unit_norm)
        if self.temperature:  # [T] fp32 scales (as transformers multiplies, then rounds)
            q = (q * rope.temperature[:, None, None]).to(q.dtype)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = attention(
            q, k, v, layer_cache, meta, self.window, self.softcap, self.k_scale, self.v_scale,
            self.sinks,
        )  # fmt: skip
        return self.o_proj(attn.reshape(num_tokens, self.q_size))

    def _head_norm(self, x: torch.Tensor, weight: nn.Parameter | None) -> torch.Tensor:
        """Per-head RMSNorm of [T, heads, d] (Qwen3, Gemma 3): the norms take the heads as
        they are, a view into the qkv rows (kernels/ops.py AddRmsNorm)."""
        if weight is None:
            return x
        return self.ops.add_rms_norm(x, None, weight, self.eps)[0]

    def _norm(self, x: torch.Tensor, weight: nn.Parameter | None) -> torch.Tensor:
        return x if weight is None else self.ops.add_rms_norm(x, None, weight, self.eps)[0]

    def _mlp(self, h: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        if self.moe_block is not None:
            return self.moe_block(h, ops)
        if self.experts is None:
            return self.down(self.activation(self.gate_up(h)))
        routed = self.experts(h, ops.fused_moe, self.activation)
        if not self.has_mlp:
            return routed
        return self.down(self.activation(self.gate_up(h))) + routed  # Llama 4's shared expert


class RopeRows(NamedTuple):
    """The batch's rows of the cos/sin tables: (cos, sin) each [T, head_dim], model dtype."""

    full: tuple[torch.Tensor, torch.Tensor]
    local: tuple[torch.Tensor, torch.Tensor] | None
    temperature: torch.Tensor | None = None  # Llama 4's NoPE layers': fp32 [T] scales of q


class Decoder(nn.Module):
    """Token ids and positions of a flat batch in, final hidden states out."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_positions: int,
        ops: KernelOps,
        shard: Shard | None = None,
        group: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.shard = shard = shard or Shard.of(config)
        self.group = group
        self.kv = kv_groups(
            config.layer_windows, config.num_layers, config.cacheless_layers
        )  # each layer's cache slot
        self.state_idx = state_indices(config)  # each recurrent layer's states
        # [vocab_per_rank, hidden]: the rank's rows of the vocab, padded to N * vocab_per_rank
        self.embed_tokens = nn.Parameter(
            torch.empty(shard.vocab_per_rank, config.hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, idx, dtype, ops, shard, group) for idx in range(config.num_layers)
        )
        self.norm = nn.Parameter(
            torch.empty(config.hidden_size, dtype=norm_dtype(config, dtype)), requires_grad=False
        )
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty_like(self.embed_tokens), requires_grad=False)
        )
        self.lm_head_matmul, _ = make_linear(self.lm_head, None, pack=False)
        cos, sin = cos_sin_table(config, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.has_local_rope = config.local_rope_theta is not None
        if self.has_local_rope:  # Gemma 3's sliding layers
            local_cos, local_sin = cos_sin_table(config, max_positions, local=True)
            self.register_buffer("local_cos", local_cos, persistent=False)
            self.register_buffer("local_sin", local_sin, persistent=False)
        self.longrope_length = longrope_original_length(config)
        if self.longrope_length is not None:  # Phi-3's LongRoPE: cos / sin hold the short one
            long_cos, long_sin = cos_sin_table(config, max_positions, long=True)
            self.register_buffer("long_cos", long_cos, persistent=False)
            self.register_buffer("long_sin", long_sin, persistent=False)

    def build_matmuls(self, pack: bool = True) -> None:
        """Call once the weights are loaded and on their device: packs them where that is faster."""
        for layer in self.layers:
            layer.build_matmuls(pack)
        # a tied lm_head is also the embedding table, so its plain weight stays and the packed
        # one is a copy: vocab x hidden more (SmolLM2: 49152 x 576, 56.6 MB in bf16), kept
        # only where packed was timed faster (engine/model/linear_choice.py)
        self.lm_head_matmul, packed = make_linear(self.lm_head, None, pack)
        if packed and not self.config.tie_word_embeddings:
            release(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attention: PagedAttention,
        meta: AttentionMetadata,
        recurrent: RecurrentBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions int64 [T]; kv_cache [slots, 2, blocks, bs, kv_heads, d]: one
        slot per layer, or with several KV groups (engine/kv/kv_groups.py) one per layer of
        a group, and `meta` one per group; `recurrent` the recurrent layers' states."""
        x, rope = self.embed(input_ids, positions, meta)
        return self.run_layers(x, rope, kv_cache, attention, meta, recurrent)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, "RopeRows"]:
        """The first layer's input and the batch's rotary rows (forward's first part)."""
        x = self._embed(input_ids)
        dtype = self.embed_tokens.dtype
        if self.config.embedding_multiplier != 1.0:  # Granite's
            x = x * self.config.embedding_multiplier
        if self.config.gemma_norms:  # the scale rounded to the model's dtype, as transformers does
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=dtype)
        metas = meta if isinstance(meta, tuple) else (meta,)
        rope = self._rope_rows(positions, metas[0], dtype)
        if self.config.attn_temperature is not None:
            rope = rope._replace(temperature=self._temperature(positions))
        return x, rope

    def run_layers(
        self,
        x: torch.Tensor,
        rope: "RopeRows",
        kv_cache: torch.Tensor,
        attention: PagedAttention,
        meta: AttentionMetadata,
        recurrent: RecurrentBatch | None = None,
    ) -> torch.Tensor:
        """The layers and the final norm over embed's output (forward's second part: what a
        decode step's graph replays, engine/worker/decode_graphs.py). Changes x in place."""
        metas = meta if isinstance(meta, tuple) else (meta,)
        delta = None
        layers = zip(self.layers, self.kv.layer_group, self.kv.layer_slot, self.state_idx)
        for layer, group, slot, state_idx in layers:
            cache = kv_cache[slot] if state_idx < 0 else recurrent.layer(state_idx)
            x, delta = layer(x, delta, rope, attention, cache, metas[group])
        return self.ops.add_rms_norm(x, delta, self.norm, self.config.rms_norm_eps)[0]

    def _rope_rows(
        self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype
    ) -> RopeRows:
        full = (self.cos[positions].to(dtype), self.sin[positions].to(dtype))
        if self.longrope_length is not None:
            # tokens of sequences whose context reaches past the pre-training length: long
            q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()
            long_seq = meta.seq_lens.to(q_lens.device) > self.longrope_length
            long = torch.repeat_interleave(long_seq, q_lens, output_size=positions.shape[0])
            long = long.to(positions.device)[:, None]
            full = (
                torch.where(long, self.long_cos[positions].to(dtype), full[0]),
                torch.where(long, self.long_sin[positions].to(dtype), full[1]),
            )
        if not self.has_local_rope:
            return RopeRows(full, None)
        return RopeRows(
            full, (self.local_cos[positions].to(dtype), self.local_sin[positions].to(dtype))
        )

    def _temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """Llama 4's attention temperature of each token's position, as transformers computes
        it: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, in fp32."""
        floor_scale, attn_scale = self.config.attn_temperature
        return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(input_ids, self.embed_tokens)
        # vocab-parallel: ids outside this rank's rows give zeros; the all-reduce fills them in
        local_ids = input_ids - self.shard.vocab_start
        inside = (local_ids >= 0) & (local_ids < self.shard.vocab_per_rank)
        x = F.embedding(local_ids.clamp(0, self.shard.vocab_per_rank - 1), self.embed_tokens)
        return self.group.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] -> fp32 [num_sampled, vocab] (gathered from every rank)."""
        logits = self.lm_head_matmul(hidden)
        if self.config.logits_scaling != 1.0:  # Granite's, in the model's dtype as transformers
            logits = logits / self.config.logits_scaling
        if self.group is not None:
            logits = self.group.all_gather(logits)[:, : self.config.vocab_size]
        logits = logits.float()
        if cap := self.config.final_logit_softcapping:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits
