"""A tiny Qwen3-Next causal LM assembled from kvpager's pieces, for tests: the gated DeltaNet
mixer on state slots, gated attention on paged caches, the shared-expert MoE, (1 + w) norms.
What the decoder does once it selects these pieces by config (engine/families/qwen3_next.py);
here a plain loop, one sequence, so the pieces' composition is checked against transformers."""

import torch
import torch.nn.functional as F
from kvpager.engine.families.qwen3_next import DeltaNetDims, deltanet_dims
from kvpager.engine.model.attention import AttentionMetadata, PagedAttention
from kvpager.engine.model.qwen3_next.gated_attention import GatedAttention
from kvpager.engine.model.qwen3_next.gated_deltanet import GatedDeltaNet, allocate_states
from kvpager.engine.model.qwen3_next.shared_expert_moe import SharedExpertMoe
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops

BLOCK = 4


class TinyQwen3Next:
    def __init__(self, hf_model, chunk_size: int = 4, num_blocks: int = 16) -> None:
        config = hf_model.config
        raw = {**config.to_dict(), "model_type": "qwen3_next"}
        self.ops = get_kernel_ops("torch")
        self.eps, self.kinds = config.rms_norm_eps, config.layer_types
        dims = DeltaNetDims(**{**deltanet_dims(raw).__dict__, "chunk_size": chunk_size})
        self.layers = [
            self._layer(config, dims, kind, hf_layer)
            for kind, hf_layer in zip(self.kinds, hf_model.model.layers)
        ]
        self.weights: dict[str, torch.Tensor] = {}
        for name, tensor in hf_model.state_dict().items():
            self._load(name, tensor.detach())
        self.cos, self.sin = self._rope_table(config, num_blocks * BLOCK)
        self.attention = PagedAttention(self.ops, config.head_dim**-0.5)
        num_linear = self.kinds.count("linear_attention")
        self.states = allocate_states(dims, num_linear, 2, torch.float32, "cpu")
        kv_shape = (2, num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
        self.caches = [torch.zeros(kv_shape) for _ in self.kinds]
        self.block_table = list(range(num_blocks))[::-1]  # blocks out of order

    def _layer(self, config, dims: DeltaNetDims, kind: str, hf_layer) -> dict:
        if kind == "linear_attention":
            layer = {"mixer": GatedDeltaNet(dims, torch.float32)}
        else:
            mixer = GatedAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, self.eps, torch.float32,
            )  # fmt: skip
            layer = {"mixer": mixer}
        if hf_layer.mlp.__class__.__name__ == "Qwen3NextSparseMoeBlock":
            # the routed experts' fields: Qwen3-Next routes as Qwen3-MoE (the MoE test says)
            raw = {**config.to_dict(), "model_type": "qwen3_moe",
                   "rope_parameters": {"rope_theta": 1.0}}  # fmt: skip
            shared = config.shared_expert_intermediate_size
            layer["moe"] = SharedExpertMoe(ModelConfig.from_dict(raw), shared, torch.float32)
        return layer

    @staticmethod
    def _rope_table(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, rotary_dim]: RoPE on head_dim * partial_rotary_factor."""
        rope = config.rope_parameters
        rotary_dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, rotary_dim, 2) / rotary_dim)
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    def _load(self, name: str, tensor: torch.Tensor) -> None:
        if not name.startswith("model.layers."):
            self.weights[name] = tensor
            return
        idx, part, rest = name.removeprefix("model.layers.").split(".", 2)
        layer = self.layers[int(idx)]
        if part in ("linear_attn", "self_attn"):
            layer["mixer"].load_tensor(rest, tensor)
        elif part == "mlp" and "moe" in layer:
            layer["moe"].load_tensor(rest, tensor)
        else:
            layer[f"{part}.{rest}"] = tensor

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm(x, None, weight.float() + 1.0, self.eps)[0]

    def forward(self, input_ids: torch.Tensor, start: int, slot: int = 1) -> torch.Tensor:
        """Logits [T, vocab] of tokens at positions start.. of the one sequence, in `slot`."""
        num_tokens = input_ids.shape[0]
        x = F.embedding(input_ids, self.weights["model.embed_tokens.weight"])
        meta, rows = self._meta(start, start + num_tokens), slice(start, start + num_tokens)
        state_idx = 0
        for kind, layer, cache in zip(self.kinds, self.layers, self.caches):
            h = self._norm(x, layer["input_layernorm.weight"])
            if kind == "linear_attention":
                conv, rule = self.states.conv[state_idx], self.states.ssm[state_idx]
                h = layer["mixer"](h, [num_tokens], [slot], conv, rule)
                state_idx += 1
            else:
                h = layer["mixer"](h, self.cos[rows], self.sin[rows], self.attention, cache,
                                   meta, self.ops)  # fmt: skip
            x = x + h
            h = self._norm(x, layer["post_attention_layernorm.weight"])
            x = x + (layer["moe"](h, self.ops) if "moe" in layer else self._mlp(h, layer))
        x = self._norm(x, self.weights["model.norm.weight"])
        return F.linear(x, self.weights["lm_head.weight"])

    @staticmethod
    def _mlp(h: torch.Tensor, layer: dict) -> torch.Tensor:
        gate = F.silu(F.linear(h, layer["mlp.gate_proj.weight"]))
        return F.linear(
            gate * F.linear(h, layer["mlp.up_proj.weight"]), layer["mlp.down_proj.weight"]
        )

    def _meta(self, start: int, end: int) -> AttentionMetadata:
        positions = torch.arange(start, end)
        blocks = torch.tensor(self.block_table)[positions // BLOCK]
        return AttentionMetadata(
            slot_mapping=blocks * BLOCK + positions % BLOCK,
            block_tables=torch.tensor([self.block_table], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            max_seqlen_q=end - start,
        )
