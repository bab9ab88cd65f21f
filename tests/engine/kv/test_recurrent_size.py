"""Per-sequence recurrent state bytes for hybrid models (engine/kv/recurrent_size.py), on
configs shaped like Granite 4.0 H Small, Qwen3-Next-80B-A3B and a Nemotron-H, checked
against the state tensors' own shapes (engine/model/mamba2.py) and by `kvpager kv-size`."""

import json

import pytest
import torch
from kvpager.engine.kv.recurrent_size import hybrid_size
from kvpager.engine.model.mamba2 import Mamba2Dims, RecurrentStates
from kvpager.schemas.errors import ConfigError

GRANITE_4_LIKE = {  # Granite 4.0 H Small's shape: 36 Mamba2 layers, 4 attention layers
    "model_type": "granitemoehybrid",
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "layer_types": (["mamba"] * 9 + ["attention"]) * 4,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "torch_dtype": "bfloat16",
}

QWEN3_NEXT_LIKE = {  # Qwen3-Next-80B-A3B's shape: 36 gated DeltaNet layers, 12 full
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
}


def test_granite_state_equals_the_tensors_it_sizes():
    size = hybrid_size(GRANITE_4_LIKE)
    assert (size.num_recurrent_layers, size.num_attention_layers) == (36, 4)
    dims = Mamba2Dims(4096, 128, 64, 1, 128, 4, 256)
    states = RecurrentStates.allocate(dims, 36, 1, torch.bfloat16, "meta")
    tensor_bytes = sum(t.numel() * t.element_size() for t in (states.conv, states.ssm))
    assert size.state_bytes("bfloat16") == tensor_bytes
    assert size.state_bytes("bfloat16") == 36 * (8448 * 3 * 2 + 128 * 64 * 128 * 4)
    assert size.kv_bytes_per_token("bfloat16") == 4 * 2 * 8 * 128 * 2


def test_qwen3_next_state():
    size = hybrid_size(QWEN3_NEXT_LIKE)
    assert (size.num_recurrent_layers, size.num_attention_layers) == (36, 12)
    conv = 36 * (2 * 16 * 128 + 32 * 128) * 3
    assert size.state_bytes("bfloat16") == conv * 2 + 36 * 32 * 128 * 128 * 4
    assert size.kv_bytes_per_token("bfloat16") == 12 * 2 * 2 * 256 * 2


def test_nemotron_h_pattern():
    raw = {
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hybrid_override_pattern": "M-M*-M-",
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 32,
        "conv_kernel": 4,
    }
    size = hybrid_size(raw)
    assert (size.num_recurrent_layers, size.num_attention_layers) == (3, 1)
    assert size.conv_elements == 3 * (8 * 16 + 2 * 2 * 32) * 3
    assert size.ssm_elements == 3 * 8 * 16 * 32
    assert hybrid_size({"model_type": "llama"}) is None


def test_kv_size_command_reports_state_bytes(tmp_path, capsys):
    from kvpager.services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(GRANITE_4_LIKE))
    assert main(["kv-size", str(tmp_path), "--tokens", "8192", "--budget-gib", "40"]) == 0
    out = capsys.readouterr().out
    state = hybrid_size(GRANITE_4_LIKE).state_bytes("bfloat16")
    assert f"state bytes per sequence:  {state:,}" in out
    assert "36 recurrent layers, 4 attention layers" in out


def test_per_rank_sizes_under_tensor_parallelism(tmp_path, capsys):
    """A rank's state holds its 64 heads and the one group (replicated); its KV heads half."""
    from kvpager.services.cli import main

    size = hybrid_size(GRANITE_4_LIKE, tensor_parallel_size=2)
    assert size.state_bytes("bfloat16") == 36 * ((4096 + 2 * 128) * 3 * 2 + 64 * 64 * 128 * 4)
    assert size.kv_bytes_per_token("bfloat16") == 4 * 2 * 4 * 128 * 2
    (tmp_path / "config.json").write_text(json.dumps(GRANITE_4_LIKE))
    args = ["kv-size", str(tmp_path), "--tensor-parallel-size", "2", "--budget-gib", "40"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"state bytes per sequence:  {size.state_bytes('bfloat16'):,}" in out
    assert "per rank of 2" in out
    with pytest.raises(ConfigError, match="3 does not divide the Mamba heads"):
        hybrid_size(GRANITE_4_LIKE, tensor_parallel_size=3)
    deltanet = hybrid_size(QWEN3_NEXT_LIKE, tensor_parallel_size=2)  # 8 key, 16 value heads
    conv = 36 * (2 * 8 * 128 + 16 * 128) * 3
    assert deltanet.state_bytes("bfloat16") == conv * 2 + 36 * 16 * 128 * 128 * 4
    with pytest.raises(ConfigError, match="32 does not divide the DeltaNet key heads"):
        hybrid_size(QWEN3_NEXT_LIKE, tensor_parallel_size=32)


def test_nemotron_h_layer_list_sizes_as_its_pattern(tmp_path, capsys):
    """transformers 5 writes the pattern as `layers_block_type`: kv-size reads it alike, and
    its sizes are what the served model holds (ModelConfig's KV layers, the state tensors)."""
    from kvpager.engine.model_config import ModelConfig
    from kvpager.services.cli import main

    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    pattern = "M-M*EM*-"
    raw = {"model_type": "nemotron_h", "vocab_size": 384, "hidden_size": 64,
           "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
           "ssm_state_size": 32, "conv_kernel": 4, "n_routed_experts": 4,
           "layers_block_type": [kinds[k] for k in pattern]}  # fmt: skip
    size = hybrid_size(raw)
    assert size == hybrid_size(
        {**raw, "layers_block_type": None, "hybrid_override_pattern": pattern}
    )
    assert (size.num_recurrent_layers, size.num_attention_layers) == (3, 2)
    config = ModelConfig.from_dict(raw)
    assert size.kv_bytes_per_token("bfloat16") == config.kv_bytes_per_token("bfloat16")
    states = RecurrentStates.allocate(config.mamba_dims, 3, 1, torch.bfloat16, "meta")
    tensor_bytes = sum(t.numel() * t.element_size() for t in (states.conv, states.ssm))
    assert size.state_bytes("bfloat16") == tensor_bytes
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["kv-size", str(tmp_path), "--tokens", "1024", "--budget-gib", "1"]) == 0
    assert "nemotron_h: 3 recurrent layers, 2 attention layers" in capsys.readouterr().out
