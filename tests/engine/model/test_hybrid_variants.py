"""Recurrent hybrids on configs unlike their own tests' (tests/engine/model/hybrid_variants.py;
the full sweep, which also runs n = 3, the C kernels and every config: hybrid_sweep.py),
greedy-equal to transformers roomy, and under recompute preemption with 5-token prefill
chunks and from a repeated prompt's state snapshot where the bug was there; every block and
state slot free after each run. Each kept config once caught a bug:

- a `time_step_limit` that bites: transformers clamps dt in a prompt's chunked scan alone,
  never in a decode step, so outputs (recomputed after a preemption too) stay unclamped;
- Nemotron-H with a `sliding_window`, which transformers' NemotronH does not read;
- Nemotron-H MLPs by another `mlp_hidden_act` than relu2 (silu, gelu_pytorch_tanh);
- Nemotron-H's older field names (`mamba_d_conv`, ...), and Granite 4's defaults for fields
  a config.json leaves out (no RoPE, 8 experts), as transformers reads them."""

import pytest
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import CheckpointError

from tests.engine.model import hybrid_checks as checks
from tests.engine.model.hybrid_variants import SWEEP, SWEEP_PROMPTS
from tests.engine.model.test_parity import MAX_TOKENS

# name -> whether to also run it under recompute preemption, and a repeated prompt through a
# state snapshot (a clamped dt must stay off the outputs, recomputed or not)
KEPT = {
    "granite_two_layers_state4_dt_limit": True,
    "nemotron_long_M_run_biases": True,
    "nemotron_*EM-M_moe_group1_no_norm": False,
    "nemotron_mha_groups2_keep2_top4_gelu": False,
}


@pytest.mark.parametrize("name", list(KEPT))
def test_a_variant_matches_transformers(tmp_path, name):
    variant = SWEEP[name]
    path = variant.build(tmp_path / "model")
    expected = variant.hf_greedy(path, SWEEP_PROMPTS, MAX_TOKENS)
    checks.check_roomy(path, SWEEP_PROMPTS, expected)
    if KEPT[name]:
        checks.check_recompute(path, SWEEP_PROMPTS, expected, num_blocks=10, chunk=5, seqs=4)
        variant.check_repeated(path)


NEMOTRON = dict(model_type="nemotron_h", vocab_size=384, hidden_size=64, intermediate_size=48,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4,
                mamba_head_dim=16, n_groups=2, ssm_state_size=8, n_routed_experts=4,
                moe_intermediate_size=32, moe_shared_expert_intermediate_size=40,
                hybrid_override_pattern="M*-E", sliding_window=4)  # fmt: skip


def test_nemotron_h_fields_read_as_transformers_reads_them():
    """No window; the older names win over the current ones; relu2 or another activation on
    the ungated MLP; mlp_bias refused."""
    old_names = dict(mamba_d_conv=2, mamba_n_groups=4, mamba_chunk_size=5,
                     mamba_dt_limit=[0.0, 0.5], mamba_conv_bias=False)  # fmt: skip
    config = ModelConfig.from_dict({**NEMOTRON, **old_names, "mlp_hidden_act": "silu"})
    dims = config.mamba_dims
    assert config.layer_windows in ((), (0,) * 4) and config.sliding_window is None
    assert (dims.conv_kernel, dims.num_groups, dims.chunk_size) == (2, 4, 5)
    assert dims.time_step_limit == (0.0, 0.5) and not config.mamba_conv_bias
    assert config.hidden_act == "silu" and not config.gated_mlp
    with pytest.raises(CheckpointError, match="mlp_bias"):
        ModelConfig.from_dict({**NEMOTRON, "mlp_bias": True})


def test_granite_defaults_are_transformers_defaults():
    raw = dict(model_type="granitemoehybrid", vocab_size=384, hidden_size=64,
               intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               layer_types=["mamba", "attention"], mamba_n_heads=4)  # fmt: skip
    config = ModelConfig.from_dict(raw)
    assert config.nope_layers == (True, True) and config.num_experts == 8
    assert config.uses_rope(1) is False
