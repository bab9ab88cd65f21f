"""DeepSeek V3 (`deepseek_v3`) as decoder switches, read as transformers' DeepseekV3Config
reads them:

- Multi-head latent attention (engine/model/mla.py): q through a low-rank `q_a_proj` ->
  `q_a_layernorm` -> `q_b_proj` (or one `q_proj` where `q_lora_rank` is None); keys and values
  from one latent of `kv_lora_rank` per token (`kv_a_proj_with_mqa` -> `kv_a_layernorm`) that
  `kv_b_proj` up-projects per head, beside one rotary key of `qk_rope_head_dim` shared by
  every head. The cache holds that latent and rotary key, nothing per head.
- RoPE on the `qk_rope_head_dim` part only (`head_dim` is that part, as transformers sets
  it); `rope_interleave` rotates adjacent pairs, so the loader reorders those rows as for
  Llama 4. The softmax scale is qk_head_dim^-0.5, times YaRN's mscale(mscale_all_dim)^2.
- MoE after `first_k_dense_replace` dense layers: sigmoid scores, the top 2 of each of
  `n_group` groups (with `e_score_correction_bias`) choose `topk_group` groups, the top k of
  their experts (by score + bias) are weighted by their scores (renormalised with
  `norm_topk_prob`) times `routed_scaling_factor`; `n_shared_experts` shared experts beside.

DeepSeek V2 (`deepseek_v2`) differs in its RoPE, always on adjacent pairs (transformers
multiplies complex numbers), and its router: a softmax over all experts; `topk_method`
"greedy" takes the top k, "group_limited_greedy" first keeps the `topk_group` groups with
the best single score; the chosen scores, never renormalised, times `routed_scaling_factor`
(no correction bias). Its defaults: no dense layers first, two shared experts.
"""

from typing import Any

from kvpager.schemas.errors import CheckpointError

DEEPSEEK_V3 = "deepseek_v3"
DEEPSEEK_V2 = "deepseek_v2"
DEEPSEEK = (DEEPSEEK_V2, DEEPSEEK_V3)


def deepseek_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The raw config with `head_dim` the rotary part (transformers' DeepseekV3Config sets it
    so) and one KV head (the latent, shared by every head); others as they are."""
    if raw.get("model_type") not in DEEPSEEK:
        return raw
    return {**raw, "head_dim": raw.get("qk_rope_head_dim", 64), "num_key_value_heads": 1}


def deepseek_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields DeepSeek V3 (or V2) sets beyond the common ones."""
    v2 = raw.get("model_type") == DEEPSEEK_V2
    fields = _v3_fields(raw) if not v2 else _v3_fields(
        {"first_k_dense_replace": 0, "n_shared_experts": 2, "moe_intermediate_size": 1407,
         "routed_scaling_factor": 1.0, **raw}
    )  # fmt: skip
    if not v2:
        return fields
    if raw.get("mlp_bias"):  # V2's MLPs and experts with biases: none of the checkpoints'
        raise CheckpointError("deepseek_v2: mlp_bias is not supported")
    grouped = raw.get("topk_method", "greedy") == "group_limited_greedy"
    groups = (raw.get("n_group") or 1, raw.get("topk_group") or 1) if grouped else (1, 1)
    return {**fields, "rope_interleaved": True, "moe_router": "deepseek_v2",
            "expert_groups": groups, "norm_topk_prob": False}  # fmt: skip


def _v3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    num_layers = raw["num_hidden_layers"]
    first_dense = raw.get("first_k_dense_replace", 3) or 0
    moe_width = raw.get("moe_intermediate_size", 2048)
    return dict(
        kv_lora_rank=raw.get("kv_lora_rank", 512),
        q_lora_rank=raw.get("q_lora_rank") or 0,
        qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
        v_head_dim=raw.get("v_head_dim", 128),
        rope_interleaved=raw.get("rope_interleave", True),
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        num_experts=raw.get("n_routed_experts", 256),
        num_experts_per_tok=raw.get("num_experts_per_tok", 8),
        moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=moe_width * (raw.get("n_shared_experts", 1) or 0),
        norm_topk_prob=raw.get("norm_topk_prob", True),
        moe_router="deepseek",
        expert_groups=(raw.get("n_group", 8) or 1, raw.get("topk_group", 4) or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        o_proj_bias=bool(raw.get("attention_bias", False)),  # added after the all-reduce
    )
