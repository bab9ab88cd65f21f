"""Tiny seeded recurrent hybrids drawn unlike the family tests' own configs: other layer
orders (Mamba or attention first or last, long Mamba runs, one full attention layer in 3 or
4), group counts, state sizes, conv widths 2-4, scan chunks that do not divide the prompts,
expand factors, dense and MoE variants, other head ratios and rotary fractions, tied
embeddings. The sweep (hybrid_sweep.py) runs them all; test_hybrid_variants.py a few."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.engine.helpers import random_prompts
from tests.engine.model import hybrid_checks
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy
from tests.model_families import build_granite_hybrid, build_nemotron_h, build_qwen3_next
from tests.qwen3_5_models import build_qwen3_5, hf_greedy_by_class

# prompts longer than a block of 8 and not aligned to it, a one-token one, one of 41
SWEEP_PROMPTS = random_prompts([1, 7, 9, 13, 23, 30, 41], seed=29)
M, A = "mamba", "attention"
L, F = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Variant:
    build: Callable[[Path], Path]
    # (path, prompts, max_tokens) -> transformers' greedy tokens
    hf_greedy: Callable = hf_greedy
    qwen3_5: str = ""  # the VARIANTS key of a Qwen3.5 checkpoint, else ""

    def check_repeated(self, path: Path) -> None:
        if not self.qwen3_5:
            hybrid_checks.check_repeated_prompt(path)
        else:
            reference = lambda ps: self.hf_greedy(path, ps, MAX_TOKENS)  # noqa: E731
            hybrid_checks.check_repeated_prompt(path, reference, max_num_batched_tokens=20)


def _qwen3_5(variant: str, seed: int, tied: bool = False, **fields) -> Variant:
    return Variant(
        build=lambda p: build_qwen3_5(p, variant, seed=seed, tied=tied, **fields),
        hf_greedy=lambda path, ps, n: hf_greedy_by_class(path, variant, ps, n),
        qwen3_5=variant,
    )


def _rope(fraction: float, section: list[int]) -> dict:
    return dict(rope_type="default", rope_theta=5000.0, partial_rotary_factor=fraction,
                mrope_section=section, mrope_interleaved=True)  # fmt: skip


# fmt: off
GRANITE = {
    "granite_attn_first_mamba_last_dense_tied": lambda p: build_granite_hybrid(
        p, seed=61, num_hidden_layers=4, layer_types=[A, M, A, M], mamba_n_heads=8,
        mamba_d_head=8, mamba_n_groups=4, mamba_d_state=16, mamba_d_conv=2, mamba_chunk_size=5,
        position_embedding_type="nope", num_local_experts=0, shared_intermediate_size=24,
        tie_word_embeddings=True,
    ),
    "granite_expand2_conv3_moe_top1": lambda p: build_granite_hybrid(
        p, seed=62, layer_types=[M, M, A], mamba_expand=2, mamba_n_heads=4, mamba_d_head="auto",
        mamba_n_groups=1, mamba_d_conv=3, mamba_chunk_size=7, num_local_experts=3,
        num_experts_per_tok=1, mamba_conv_bias=False, mamba_proj_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, embedding_multiplier=0.6,
        residual_multiplier=0.9, logits_scaling=3.0, attention_multiplier=0.125,
        attention_bias=True,
    ),
    "granite_two_layers_state4_dt_limit": lambda p: build_granite_hybrid(
        p, seed=63, num_hidden_layers=2, layer_types=[M, A], mamba_d_state=4, mamba_chunk_size=3,
        time_step_limit=(0.05, 0.8), rms_norm_eps=1e-5, shared_intermediate_size=16,
        num_local_experts=5, num_experts_per_tok=3,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "granite_heads6_groups3_expand3_mqa": lambda p: build_granite_hybrid(
        p, seed=64, num_hidden_layers=4, layer_types=[M, A, M, M], mamba_expand=3,
        mamba_n_heads=6, mamba_d_head="auto", mamba_n_groups=3, mamba_chunk_size=6,
        num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=2,
        tie_word_embeddings=True,
    ),
    "granite_yarn_attention_last": lambda p: build_granite_hybrid(
        p, seed=65, layer_types=[M, M, A], mamba_chunk_size=2, mamba_d_state=6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16},
    ),
}

NEMOTRON = {
    "nemotron_M-M*-_groups4_conv2": lambda p: build_nemotron_h(
        p, seed=71, hybrid_override_pattern="M-M*-", n_groups=4, chunk_size=3, conv_kernel=2,
        residual_in_fp32=True, intermediate_size=40,
    ),
    # sliding_window: transformers' NemotronH reads none (full attention)
    "nemotron_*EM-M_moe_group1_no_norm": lambda p: build_nemotron_h(
        p, seed=72, hybrid_override_pattern="*EM-M", n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=1, norm_topk_prob=False, n_groups=1, ssm_state_size=16,
        mamba_num_heads=8, mamba_head_dim=8, chunk_size=7, conv_kernel=3, sliding_window=5,
    ),
    "nemotron_long_M_run_biases": lambda p: build_nemotron_h(
        p, seed=73, hybrid_override_pattern="MMMM*M-", mamba_num_heads=2, mamba_head_dim=32,
        n_groups=2, time_step_limit=(0.0, 1.0), use_conv_bias=False, use_bias=True,
        rescale_prenorm_residual=False, residual_in_fp32=True, num_attention_heads=2,
        num_key_value_heads=1, head_dim=24, mlp_hidden_act="silu",
    ),
    "nemotron_mha_groups2_keep2_top4_gelu": lambda p: build_nemotron_h(
        p, seed=74, hybrid_override_pattern="M*E-*M", n_routed_experts=8, n_group=2, topk_group=2,
        num_experts_per_tok=4, num_key_value_heads=4, head_dim=8, chunk_size=16, n_groups=4,
        mlp_hidden_act="gelu_pytorch_tanh",
    ),
    "nemotron_tiny_heads_chunk2_eps": lambda p: build_nemotron_h(
        p, seed=75, hybrid_override_pattern="MEM*E", mamba_num_heads=8, mamba_head_dim=4,
        ssm_state_size=4, n_groups=1, chunk_size=2, layer_norm_epsilon=1e-6,
        residual_in_fp32=True, moe_shared_expert_intermediate_size=8,
    ),
}

QWEN3_NEXT = {
    "qwen3_next_interval3_ratio1_conv2": lambda p: build_qwen3_next(
        p, seed=81, num_hidden_layers=6, full_attention_interval=3, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_value_head_dim=8, linear_conv_kernel_dim=2,
        partial_rotary_factor=0.5, decoder_sparse_step=2, mlp_only_layers=[],
        norm_topk_prob=False, shared_expert_intermediate_size=24,
    ),
    "qwen3_next_interval4_ratio4_conv3": lambda p: build_qwen3_next(
        p, seed=82, full_attention_interval=4, linear_num_key_heads=1, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_conv_kernel_dim=3, partial_rotary_factor=1.0, num_experts=5,
        num_experts_per_tok=3, mlp_only_layers=[0], attention_bias=True,
    ),
    "qwen3_next_keydim32_value8_top1_sparse3": lambda p: build_qwen3_next(
        p, seed=83, num_hidden_layers=6, linear_key_head_dim=32, linear_value_head_dim=8,
        num_experts_per_tok=1, decoder_sparse_step=3, mlp_only_layers=[2], head_dim=32,
        num_attention_heads=2, num_key_value_heads=2, partial_rotary_factor=0.75,
    ),
    "qwen3_next_heads8_dim8_linear_rope": lambda p: build_qwen3_next(
        p, seed=84, num_hidden_layers=3, full_attention_interval=3, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    ),
}

QWEN3_5 = {
    "qwen3_5_text_LLLF_ratio1_conv2": _qwen3_5(
        "qwen3_5_text", 91, layer_types=[L, L, L, F], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_conv_kernel_dim=2, rope_parameters=_rope(0.5, [2, 1, 1]),
    ),
    "qwen3_5_moe_text_FLL_ratio4_top1": _qwen3_5(
        "qwen3_5_moe_text", 92, num_hidden_layers=3, layer_types=[F, L, L],
        linear_num_key_heads=1, linear_num_value_heads=4, linear_conv_kernel_dim=3, num_experts=3,
        num_experts_per_tok=1, shared_expert_intermediate_size=16,
    ),
    "qwen3_5_moe_LFF_tied": _qwen3_5(
        "qwen3_5_moe", 93, tied=True, num_hidden_layers=3, layer_types=[L, F, F],
        linear_key_head_dim=8, linear_value_head_dim=24,
    ),
    "qwen3_5_text_full_rotary_head32_bias": _qwen3_5(
        "qwen3_5_text", 94, num_hidden_layers=5, layer_types=[L, F, L, F, L], head_dim=32,
        rope_parameters=_rope(1.0, [8, 4, 4]), attention_bias=True,
    ),
    "qwen3_5_moe_text_6_layers_head8": _qwen3_5(
        "qwen3_5_moe_text", 95, num_hidden_layers=6, layer_types=[L, L, F, L, L, F], head_dim=8,
        num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=8,
        rope_parameters=_rope(0.5, [1, 1, 0]),
    ),
}

# fmt: on
SWEEP: dict[str, Variant] = {
    **{name: Variant(build) for name, build in {**GRANITE, **NEMOTRON, **QWEN3_NEXT}.items()},
    **QWEN3_5,
}
