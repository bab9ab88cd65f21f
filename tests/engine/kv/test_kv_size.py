"""The planning tool's arithmetic, checked on the seed's example (Llama 3.1 70B)."""

import json

import torch
from kvpager.engine.kv.kv_size import kv_size, weight_bytes_per_rank
from kvpager.engine.model_config import ModelConfig

LLAMA_31_70B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}


def test_llama_70b_sequence_is_about_1_3_gb():
    config = ModelConfig.from_dict(LLAMA_31_70B)
    report = kv_size(
        config,
        torch.bfloat16,
        max_tokens=4096,
        users=256,
        budget_bytes=80 * 1024**3,
        avg_tokens=1000,
    )
    assert report.bytes_per_token == 2 * 80 * 8 * 128 * 2  # K and V, layers, heads, dim, bf16
    assert report.bytes_per_sequence == 327_680 * 4096  # 1.34 GB
    assert report.total_bytes == 256 * report.bytes_per_sequence
    assert report.contiguous_sequences == (80 * 1024**3) // (327_680 * 4096) == 64
    assert report.paged_sequences == (80 * 1024**3) // (327_680 * 1008)  # 63 blocks of 16
    assert abs(report.paged_utilisation - 1000 / 1008) < 1e-9


def test_kv_size_command(tmp_path, capsys):
    from kvpager.services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_70B))
    assert main(["kv-size", str(tmp_path), "--tokens", "4096", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token:        327,680" in out
    assert "contiguous max-length reservation: 64" in out
    assert main(["kv-size", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_the_seed_example_fits_with_an_fp8_cache(tmp_path, capsys):
    """The issue's command: an fp8 (e4m3) cache halves the KV bytes a token, so the 256 users
    fit paged at the 2,048-token average (501), though not all at full length (250); the
    weights stay bf16, 32.86 GiB a rank. --kv-cache-dtype is the same flag by serve's name."""
    from kvpager.services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_70B))
    args = ["kv-size", str(tmp_path), "--tokens", "4096", "--users", "256", "--gpus", "4"]
    for flag in (["--dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"], ["--dtype", "fp8_e5m2"]):
        assert main([*args, "--gpu-memory", "80GiB", *flag]) == 0
        out = capsys.readouterr().out
        assert "weights per rank:          35,278,831,616 (32.86 GiB, bfloat16)" in out
        assert "KV bytes per token:        40,960 per rank (float8_e" in out  # 81,920 / 2
        assert "KV bytes for all users:    171,798,691,840 (160.00 GiB)" in out
        # 42,030,579,712 // (40,960 x 4,096) and // (40,960 x 2,048)
        assert "contiguous max-length reservation: 250" in out
        assert "paged at the average length:       501" in out
        assert "256 users fit paged at the average length" in out
    assert main([*args, "--dtype", "fp4"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype: unknown dtype 'fp4'" in err and "fp8_e5m2" in err


def test_the_seed_example_on_four_80gib_gpus(tmp_path, capsys):
    """70B in bf16 is 70,553,706,496 parameters; four ranks each hold 1/4 of every matrix (the
    norms whole), 2 of the 8 KV heads, and 90% of 80 GiB less their weights for the cache."""
    from kvpager.services.cli import main

    config = ModelConfig.from_dict(LLAMA_31_70B)
    assert weight_bytes_per_rank(config, torch.bfloat16) == 2 * 70_553_706_496
    per_rank = weight_bytes_per_rank(config, torch.bfloat16, 4)
    assert per_rank == 2 * (80 * (855_638_016 // 4 + 16_384) + 2 * 32_064 * 8192 + 8192)
    budget = int(80 * 1024**3 * 0.9) - per_rank
    assert budget == 42_030_579_712
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_70B))
    args = ["kv-size", str(tmp_path), "--tokens", "4096", "--users", "256", "--gpus", "4"]
    assert main([*args, "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "weights per rank:          35,278,831,616 (32.86 GiB, bfloat16)" in out
    assert "KV bytes per token:        81,920 per rank" in out  # 327,680 / 4
    assert "KV bytes for all users:    343,597,383,680 (320.00 GiB)" in out
    # 42,030,579,712 // (81,920 x 4,096) and // (81,920 x 2,048): the average is half the max
    assert "contiguous max-length reservation: 125" in out
    assert "paged at the average length:       250" in out
    assert "256 users do not fit" in out
    assert main([*args, "--gpu-memory", "80GiB", "--gpu-utilization", "1.0"]) == 0
    assert "paged at the average length:       301" in capsys.readouterr().out
    assert main([*args, "--tensor-parallel-size", "3"]) == 2
    assert "gpus: 4 is not a multiple of tensor_parallel_size 3" in capsys.readouterr().err


def test_sliding_layers_hold_only_their_window():
    """Gemma-3-like: 5 sliding layers (window 1024) for each full one, 6 layers, 8K tokens: a
    sliding layer holds 65 blocks of 16 (1040 slots) where a full one holds 512: 27% of the
    bytes of full attention."""
    raw = {**LLAMA_31_70B, "model_type": "gemma3_text", "num_hidden_layers": 6,
           "sliding_window": 1024, "sliding_window_pattern": 6, "head_dim": 128}  # fmt: skip
    config = ModelConfig.from_dict(raw)
    assert config.layer_windows == (1024,) * 5 + (0,)
    report = kv_size(config, torch.bfloat16, 8192, 1, 80 * 1024**3, avg_tokens=8192)
    per_layer_slot = 2 * 8 * 128 * 2
    assert report.bytes_per_sequence == 6 * per_layer_slot * 8192
    assert report.windowed_bytes_per_sequence == (512 + 5 * 65) * 16 * per_layer_slot
    assert report.paged_sequences == (80 * 1024**3) // report.windowed_bytes_per_sequence
    assert any("windows freeing" in line and "27%" in line for line in report.lines())


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json (transformers' GptOssConfig defaults)
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "num_local_experts": 32,
    "num_experts_per_tok": 4, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096},
}  # fmt: skip


def test_gpt_oss_20b_weights_and_windowed_kv():
    """gpt-oss-20b unquantised in bf16: weight bytes equal transformers' parameter count (its
    sinks and norm weights held in float32 here), and at 8K tokens the 12 sliding layers
    (window 128) hold 9 blocks of 16 each where the 12 full ones hold 512: 51% of the bytes."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = ModelConfig.from_dict(GPT_OSS_20B)
    assert config.attention_sinks and config.gpt_oss_experts and config.attention_bias
    with torch.device("meta"):
        model = GptOssForCausalLM(GptOssConfig(**GPT_OSS_20B))
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    in_fp32 = sum(p.numel() for n, p in params.items() if "norm" in n or n.endswith("sinks"))
    assert weight_bytes_per_rank(config, torch.bfloat16) == 2 * total + 2 * in_fp32
    report = kv_size(config, torch.bfloat16, 8192, 1, 80 * 1024**3, avg_tokens=8192)
    per_layer_slot = 2 * 8 * 64 * 2
    assert report.bytes_per_sequence == 24 * per_layer_slot * 8192
    assert report.windowed_bytes_per_sequence == (12 * 512 + 12 * 9) * 16 * per_layer_slot
    assert any("windows freeing" in line and "51%" in line for line in report.lines())
