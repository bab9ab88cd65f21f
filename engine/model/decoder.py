"""One decoder for Llama, Mistral and Qwen2; the families differ only by config switches.

Weights are fused at load time (q|k|v and gate|up), so each layer runs four matmuls. Under
tensor parallelism each rank holds its Shard (engine/model/sharding.py) and the decoder adds
the collectives: an all-reduce after o, after down and after the embedding, an all-gather of
the logits. Alone (`group` None) there are none.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.linear import make_linear
from engine.model.rope import cos_sin_table
from engine.model.sharding import Shard
from engine.parallel.group import TensorParallel
from kernels.backend import KernelOps


def _release(weight: nn.Parameter) -> None:
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


def _matmul(weight: nn.Parameter, bias: torch.Tensor | None, pack: bool):
    matmul, packed = make_linear(weight, bias, pack)
    if packed:
        _release(weight)
    return matmul


# Long batches (prefill) run the MLP in row chunks: a [512, 2 x intermediate] activation stays in
# cache between the two matmuls, where a 2,048-row one goes to memory (~10% faster prefill on
# SmolLM2 with 2 CPU threads; row results are the same either way).
MLP_CHUNK_TOKENS = 512


def _all_reduce(group: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    return x if group is None else group.all_reduce(x)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: KernelOps,
        shard: Shard,
        group: TensorParallel | None,
    ) -> None:
        super().__init__()
        self.ops = ops  # norm, rotary and activation kernels of the executor's backend
        self.group = group
        hidden, intermediate = config.hidden_size, shard.intermediate_size
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = param(hidden)
        self.qkv_weight = param(self.q_size + 2 * self.kv_size, hidden)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if config.attention_bias else None
        self.o_weight = param(hidden, self.q_size)
        self.post_attention_norm = param(hidden)
        self.gate_up_weight = param(2 * intermediate, hidden)
        self.down_weight = param(hidden, intermediate)
        self.build_matmuls(pack=False)

    def build_matmuls(self, pack: bool) -> None:
        """The four matmuls; once packed, the plain weights are released (they are copies)."""
        self.qkv = _matmul(self.qkv_weight, self.qkv_bias, pack)
        self.o_proj = _matmul(self.o_weight, None, pack)
        self.gate_up = _matmul(self.gate_up_weight, None, pack)
        self.down = _matmul(self.down_weight, None, pack)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PagedAttention,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + delta (delta None at the first layer); returns the next
        layer's (x, delta), so each residual add is fused into the norm that follows it."""
        ops = self.ops
        num_tokens = x.shape[0]
        h, x = ops.add_rms_norm(x, delta, self.input_norm, self.eps)
        qkv = self.qkv(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rotary(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            cos,
            sin,
        )
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = attention(q, k, v, layer_cache, meta).reshape(num_tokens, self.q_size)
        attn = _all_reduce(self.group, self.o_proj(attn))
        h, x = ops.add_rms_norm(x, attn, self.post_attention_norm, self.eps)
        if num_tokens <= MLP_CHUNK_TOKENS:
            return x, _all_reduce(self.group, self._mlp(h, ops))
        mlp = torch.cat([self._mlp(part, ops) for part in h.split(MLP_CHUNK_TOKENS)])
        return x, _all_reduce(self.group, mlp)

    def _mlp(self, h: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self.down(ops.silu_and_mul(self.gate_up(h)))


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
        # [vocab_per_rank, hidden]: the rank's rows of the vocab, padded to N * vocab_per_rank
        self.embed_tokens = nn.Parameter(
            torch.empty(shard.vocab_per_rank, config.hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, ops, shard, group) for _ in range(config.num_layers)
        )
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty_like(self.embed_tokens), requires_grad=False)
        )
        self.lm_head_matmul, _ = make_linear(self.lm_head, None, pack=False)
        cos, sin = cos_sin_table(config, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def build_matmuls(self, pack: bool = True) -> None:
        """Call once the weights are loaded and on their device: packs them where that is faster."""
        for layer in self.layers:
            layer.build_matmuls(pack)
        # a tied lm_head is also the embedding table, so its plain weight stays
        self.lm_head_matmul, packed = make_linear(self.lm_head, None, pack)
        if packed and not self.config.tie_word_embeddings:
            _release(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attention: PagedAttention,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions int64 [T]; kv_cache [layers, 2, blocks, bs, kv_heads, d]."""
        x = self._embed(input_ids)
        dtype = self.embed_tokens.dtype
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        delta = None
        for layer_idx, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cos, sin, attention, kv_cache[layer_idx], meta)
        return self.ops.add_rms_norm(x, delta, self.norm, self.config.rms_norm_eps)[0]

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
        if self.group is None:
            return logits.float()
        return self.group.all_gather(logits)[:, : self.config.vocab_size].float()
