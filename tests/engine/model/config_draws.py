"""Configs drawn at random for deepseek_v3, deepseek_v2, gpt_oss and llama4_text, unlike the
hand-made ones of tests/model_families.py: each draw picks the fields a family switches on
from the space transformers accepts (ranks, head dims, layer patterns, routing, RoPE
scaling), and `check_exact` runs one roomy and one preempted engine against transformers,
tie-guarded. tests/engine/model/test_config_draws.py keeps a handful; a sweep calls `draw`
over many seeds."""

import json
import random
from pathlib import Path

import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_groups import kv_groups
from kvpager.engine.model_config import ModelConfig
from transformers import AutoModelForCausalLM

from tests import model_families as fam
from tests.engine.helpers import assert_all_free, make_llm, random_prompts

TIE = 1e-4  # float32 logits this close may order differently on another summation order
S, F, C = "sliding_attention", "full_attention", "chunked_attention"


def _deepseek_fields(rng: random.Random, v2: bool) -> dict:
    layers = rng.randint(2, 4)
    groups = rng.choice([1, 2, 4])
    per_group = rng.choice([2, 3])
    topk_group = rng.randint(1, groups)
    fields = dict(
        num_hidden_layers=layers, num_attention_heads=rng.choice([2, 4, 8]),
        q_lora_rank=rng.choice([None, 16, 40]), kv_lora_rank=rng.choice([8, 20, 32]),
        qk_nope_head_dim=rng.choice([8, 12, 24]), qk_rope_head_dim=rng.choice([4, 8, 12]),
        v_head_dim=rng.choice([8, 20, 32]), first_k_dense_replace=rng.randint(0, layers),
        n_routed_experts=groups * per_group, n_group=groups, topk_group=topk_group,
        num_experts_per_tok=rng.randint(1, topk_group * per_group),
        moe_intermediate_size=rng.choice([16, 24]), n_shared_experts=rng.choice([0, 1, 2]),
        routed_scaling_factor=rng.choice([1.0, 2.5]), norm_topk_prob=rng.random() < 0.5,
        tie_word_embeddings=rng.random() < 0.3, rope_parameters=_deepseek_rope(rng),
        attention_bias=rng.random() < 0.2, hidden_act=rng.choice(["silu", "silu", "gelu"]),
    )  # fmt: skip
    fields["num_key_value_heads"] = fields["num_attention_heads"]
    if v2:
        fields["topk_method"] = rng.choice(["greedy", "group_limited_greedy"])
    else:
        fields["rope_interleave"] = rng.random() < 0.5
    return fields


def _deepseek_rope(rng: random.Random) -> dict:
    if rng.random() < 0.4:
        return {"rope_type": "default", "rope_theta": rng.choice([1e4, 5e4])}
    return {"rope_type": "yarn", "rope_theta": 1e4, "factor": rng.choice([4.0, 40.0]),
            "mscale": rng.choice([1.0, 0.707]), "mscale_all_dim": rng.choice([1.0, 0.8, 0.0]),
            "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": rng.choice([16, 64])}  # fmt: skip


def _gpt_oss_fields(rng: random.Random) -> dict:
    layers = rng.randint(2, 4)
    kv = rng.choice([1, 2, 3])
    experts = rng.randint(2, 6)
    rope = {"rope_type": "yarn", "rope_theta": rng.choice([1e4, 15e4]),
            "factor": rng.choice([4.0, 32.0]), "beta_fast": rng.choice([32.0, 8.0]),
            "beta_slow": 1.0, "truncate": rng.random() < 0.5,
            "original_max_position_embeddings": rng.choice([16, 32])}  # fmt: skip
    return dict(
        num_hidden_layers=layers, num_attention_heads=kv * rng.choice([1, 2, 4]),
        num_key_value_heads=kv, head_dim=rng.choice([8, 16, 24]),
        layer_types=[rng.choice([S, F]) for _ in range(layers)],
        sliding_window=rng.choice([3, 5, 8, 13]), num_local_experts=experts,
        num_experts_per_tok=rng.randint(1, min(4, experts)),
        intermediate_size=rng.choice([16, 40]), swiglu_limit=rng.choice([0.5, 1.5, 7.0]),
        rope_parameters=rope if rng.random() < 0.7 else {"rope_type": "default", "rope_theta": 1e4},
        tie_word_embeddings=rng.random() < 0.3, attention_bias=rng.random() < 0.7,
    )  # fmt: skip


def _llama4_fields(rng: random.Random) -> dict:
    layers = rng.randint(2, 5)
    kv = rng.choice([1, 2])
    experts = rng.randint(1, 4)
    fields = dict(
        num_hidden_layers=layers, num_attention_heads=kv * rng.choice([1, 2, 4]),
        num_key_value_heads=kv, head_dim=rng.choice([8, 16]),
        attention_chunk_size=rng.choice([8, 16, 24, 64]),
        interleave_moe_layer_step=rng.choice([1, 2]), use_qk_norm=rng.random() < 0.5,
        attn_temperature_tuning=rng.random() < 0.7, floor_scale=rng.choice([2, 5, 8192]),
        attn_scale=rng.choice([0.1, 0.7]), num_local_experts=experts,
        num_experts_per_tok=rng.randint(1, min(2, experts)),
        tie_word_embeddings=rng.random() < 0.3, attention_bias=rng.random() < 0.2,
        hidden_act=rng.choice(["silu", "silu", "gelu"]),
    )  # fmt: skip
    if rng.random() < 0.3:
        fields["moe_layers"] = [i for i in range(layers) if rng.random() < 0.5]
    if rng.random() < 0.3:
        fields["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16}  # fmt: skip
    if rng.random() < 0.5:
        fields["no_rope_layers"] = [rng.choice([0, 1]) for _ in range(layers)]
    else:
        fields["no_rope_layers"], fields["no_rope_layer_interval"] = None, rng.choice([2, 3])
    return fields


BUILDERS = {
    "deepseek_v3": (fam.build_deepseek_v3, lambda rng: _deepseek_fields(rng, v2=False)),
    "deepseek_v2": (fam.build_deepseek_v2, lambda rng: _deepseek_fields(rng, v2=True)),
    "gpt_oss": (fam.build_gpt_oss, _gpt_oss_fields),
    "llama4_text": (fam.build_llama4, _llama4_fields),
}


def draw(family: str, seed: int) -> dict:
    """The fields of draw `seed` for `family`."""
    return BUILDERS[family][1](random.Random(f"{family}-{seed}"))


def build(family: str, path: Path, seed: int, fields: dict, legacy_rope: bool = False) -> Path:
    """The checkpoint; `legacy_rope`: config.json as DeepSeek V3 ships it (`rope_scaling`
    with "type", `rope_theta` beside), not transformers 5's `rope_parameters`."""
    path = BUILDERS[family][0](path, seed=100 + seed, **fields)
    if family.startswith("deepseek") and fields.get("attention_bias"):
        _draw_biases(path, seed)
    if legacy_rope:
        raw = json.loads((path / "config.json").read_text())
        rope = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = rope.pop("rope_theta")
        kind = rope.pop("rope_type")
        raw["rope_scaling"] = None if kind == "default" else {**rope, "type": kind}
        (path / "config.json").write_text(json.dumps(raw))
    return path


def _draw_biases(path: Path, seed: int) -> None:
    """Latent attention's q_a / kv_a / o biases drawn so they matter (transformers: zeros)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias") or name.endswith("mqa.bias"):
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)


def hf_reference(path: Path, prompts: list[list[int]], max_tokens: int):
    """transformers' greedy tokens and, for the tie guard, its model."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False)  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return model, outs


def assert_tie_guarded(model, prompts, expected, got) -> None:
    """Equal, or apart only after a token transformers itself scores within TIE of its best."""
    for prompt, want, have in zip(prompts, expected, got):
        if want == have:
            continue
        at = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        assert at is not None, (prompt, want, have)  # one stopped early: a real difference
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want[:at]])).logits[0, -1]
        gap = float(logits[want[at]] - logits[have[at]])
        assert gap <= TIE, f"token {at}: {have[at]} for {want[at]}, {gap:.2e} apart: {prompt}"


def greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def check_exact(
    path: Path, lengths=(3, 14, 30), max_tokens: int = 12, n2: bool = True, **engine
) -> int:
    """Roomy (C kernels), in 5-token chunks on one long sequence's blocks a KV group
    (recompute preemption where a group holds every token), n=2: all as transformers, on
    `engine`'s settings beside. The preemptions counted."""
    prompts = random_prompts(list(lengths), seed=sum(lengths))
    model, expected = hf_reference(path, prompts, max_tokens)
    with make_llm(path, **{"attention_backend": "cpu", "num_blocks": 256, **engine}) as llm:
        assert_tie_guarded(model, prompts, expected, greedy(llm, prompts, max_tokens))
        if n2:
            params = SamplingParams(n=2, temperature=0.0, max_tokens=max_tokens)
            out = llm.generate(prompts[-1:], params, use_tqdm=False)[0]
            for choice in out.outputs:
                assert_tie_guarded(model, prompts[-1:], expected[-1:], [choice.token_ids])
        assert_all_free(llm)
    config = ModelConfig.from_path(path)
    groups = kv_groups(config.layer_windows, config.num_layers).num_groups
    per_sequence = -(-(max(lengths) + max_tokens) // engine.get("block_size", 8))
    tight = dict(num_blocks=per_sequence * groups, max_num_batched_tokens=5, max_num_seqs=3,
                 enable_prefix_caching=False)  # fmt: skip
    with make_llm(path, **{**tight, **engine}) as llm:
        assert_tie_guarded(model, prompts, expected, greedy(llm, prompts, max_tokens))
        assert_all_free(llm)
        return llm.stats()["num_preemptions"]
