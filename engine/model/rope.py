"""Rotary position embeddings as cos/sin tables: default, linear, Llama 3.1's frequency scaling,
YaRN (gpt-oss), and Phi-3's LongRoPE; Gemma 3's sliding layers get a second table with their
own base.

LongRoPE has two tables: the long one for a sequence whose context is past the pre-training
length, the short one before. The engine picks per sequence, each step, by its context length
after the step, as transformers picks per forward call. One difference is left: when a
sequence grows across that length, transformers' generate drops its KV cache and recomputes
every key with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation), while the
engine keeps the keys it cached with the short ones. Sequences that stay within the length,
and prompts already past it, are exact."""

import math

import torch
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import CheckpointError


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def longrope_original_length(config: ModelConfig) -> int | None:
    """The pre-training length past which LongRoPE switches to its long factors; None when
    the model has no LongRoPE."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return None
    return scaling["original_max_position_embeddings"]


def _longrope(
    config: ModelConfig, scaling: dict, exponents: torch.Tensor, theta: float, long: bool
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors (short or long ones) and a cos/sin scale."""
    original = scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return 1.0 / (factors * theta**exponents), attention_factor


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(
    config: ModelConfig, scaling: dict, exponents: torch.Tensor, theta: float
) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it (_compute_yarn_parameters): interpolated (divided by
    `factor`) low frequencies, extrapolated high ones, a linear ramp between the dims that
    turn beta_fast and beta_slow times over the pre-training length; cos/sin scaled by mscale."""
    dim = config.head_dim
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else _yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1: the dim keeps its frequency
    pos_freqs = theta**exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention_factor)


def inverse_frequencies(
    config: ModelConfig, local: bool = False, long: bool = False
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], cos/sin scale): rotary_dim is head_dim times the
    partial_rotary_factor (Qwen3-Next's 0.25; 1 elsewhere). `local`: Gemma 3's sliding
    layers (their own base, no scaling: a checkpoint's rope_scaling applies to the global
    layers). `long`: LongRoPE's long factors."""
    dim = int(config.head_dim * config.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta**exponents)
    scaling = {} if local else (config.rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type in ("longrope", "su"):
        return _longrope(config, scaling, exponents, theta, long)
    if rope_type == "yarn":
        return _yarn(config, scaling, exponents, theta)
    raise CheckpointError(f"rope_scaling type {rope_type!r} is not supported")


def cos_sin_table(
    config: ModelConfig, max_positions: int, local: bool = False, long: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin, each [max_positions, rotary_dim] (the half-dim angles repeated)."""
    inv_freq, scale = inverse_frequencies(config, local, long)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * scale, angles.sin() * scale
