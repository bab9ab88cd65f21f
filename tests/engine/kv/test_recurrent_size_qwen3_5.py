"""`kvpager kv-size` on Qwen3.5 configs (engine/kv/recurrent_size.py): a multimodal
`qwen3_5_moe` checkpoint is sized by its text_config (the vision tower holds no cache), shaped
as transformers' Qwen3_5MoeTextConfig defaults (Qwen3.5-35B-A3B): 30 gated DeltaNet layers
and 10 gated attention layers."""

import json

from kvpager.engine.kv.recurrent_size import hybrid_size

from tests.engine.kv.test_recurrent_size import QWEN3_NEXT_LIKE

QWEN3_5_MOE_TEXT_LIKE = {  # Qwen3-Next-80B's heads, 40 layers, 3 DeltaNet to 1 attention
    **{k: v for k, v in QWEN3_NEXT_LIKE.items() if k != "full_attention_interval"},
    "model_type": "qwen3_5_moe_text",
    "num_hidden_layers": 40,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
}
MULTIMODAL = {
    "model_type": "qwen3_5_moe",
    "text_config": QWEN3_5_MOE_TEXT_LIKE,
    "vision_config": {"depth": 27, "hidden_size": 1152},
    "torch_dtype": "bfloat16",
}


def test_text_and_multimodal_configs_size_alike():
    text, multimodal = hybrid_size(QWEN3_5_MOE_TEXT_LIKE), hybrid_size(MULTIMODAL)
    assert (text.num_recurrent_layers, text.num_attention_layers) == (30, 10)
    conv = 30 * (2 * 16 * 128 + 32 * 128) * 3
    assert text.state_bytes("bfloat16") == conv * 2 + 30 * 32 * 128 * 128 * 4
    assert text.kv_bytes_per_token("bfloat16") == 10 * 2 * 2 * 256 * 2
    assert multimodal.state_bytes("bfloat16") == text.state_bytes("bfloat16")
    assert multimodal.kv_bytes_per_token("bfloat16") == text.kv_bytes_per_token("bfloat16")
    dense = {**QWEN3_5_MOE_TEXT_LIKE, "model_type": "qwen3_5_text"}
    assert hybrid_size(dense).state_bytes("bfloat16") == text.state_bytes("bfloat16")


def test_kv_size_command_reads_the_text_config(tmp_path, capsys):
    from kvpager.services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(MULTIMODAL))
    assert main(["kv-size", str(tmp_path), "--tokens", "8192", "--budget-gib", "40"]) == 0
    out = capsys.readouterr().out
    state = hybrid_size(MULTIMODAL).state_bytes("bfloat16")
    assert "qwen3_5_moe_text: 30 recurrent layers, 10 attention layers" in out
    assert f"state bytes per sequence:  {state:,}" in out
