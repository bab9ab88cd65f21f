"""The planning tool's arithmetic, checked on the seed's example (Llama 3.1 70B)."""

import json

import torch

from engine.config import ModelConfig
from engine.kv_size import kv_size

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
    from services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_70B))
    assert main(["kv-size", str(tmp_path), "--tokens", "4096", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token:        327,680" in out
    assert "contiguous max-length reservation: 64" in out
    assert main(["kv-size", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err
