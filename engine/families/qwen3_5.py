"""Qwen3.5 text (`qwen3_5_text`, `qwen3_5_moe_text`, or the `text_config` of a multimodal
`qwen3_5` / `qwen3_5_moe` checkpoint) as Qwen3-Next's switches (engine/families/qwen3_next.py),
read as transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig read them. What differs:

- the DeltaNet's projections are four flat tensors (in_proj_qkv, in_proj_z, in_proj_b,
  in_proj_a) rather than Qwen3-Next's two grouped per key head; the mixer loads both
  (engine/model/qwen3_next/gated_deltanet.py: CHECKPOINT_TENSORS);
- `qwen3_5_text` has a dense SwiGLU MLP on every layer (no experts, no shared expert);
  `qwen3_5_moe_text` routed experts plus a gated shared expert on every layer, the top-k
  weights always renormalised (its config has no decoder_sparse_step, mlp_only_layers or
  norm_topk_prob);
- RoPE is interleaved M-RoPE (`mrope_section`); for text alone the three sections see the
  same position, so it is the plain partial RoPE Qwen3-Next has.
A multimodal checkpoint serves its text part: the text_config, the `model.language_model.*`
tensors and `lm_head`; the vision tower (`model.visual.*`) and the MTP head (`mtp.*`) are
not loaded, and requests carry text only.
"""

from typing import Any

from kvpager.engine.families.qwen3_next import qwen3_next_fields
from kvpager.schemas.errors import CheckpointError

QWEN3_5_TEXT = "qwen3_5_text"
QWEN3_5_MOE_TEXT = "qwen3_5_moe_text"
QWEN3_5_TYPES = (QWEN3_5_TEXT, QWEN3_5_MOE_TEXT)
# a multimodal checkpoint's model_type -> its text part's
MULTIMODAL_TYPES = {"qwen3_5": QWEN3_5_TEXT, "qwen3_5_moe": QWEN3_5_MOE_TEXT}
# fields transformers' multimodal config holds at its top level and its text model follows
TOP_LEVEL_FIELDS = ("tie_word_embeddings", "torch_dtype", "dtype", "eos_token_id")
LANGUAGE_MODEL_PREFIX = "model.language_model."


def qwen3_5_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal `qwen3_5` / `qwen3_5_moe` config's text part as a text config (the
    top-level tie_word_embeddings, dtype and eos win, as transformers' multimodal model ties
    and generates by them); other configs as they are."""
    model_type = raw.get("model_type")
    if model_type not in MULTIMODAL_TYPES:
        return _moe_text_defaults(raw)
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"model_type {model_type!r}: config.json has no text_config")
    top = {name: raw[name] for name in TOP_LEVEL_FIELDS if name in raw}
    return _moe_text_defaults({**text, **top, "model_type": MULTIMODAL_TYPES[model_type]})


def text_weight_name(name: str) -> str:
    """A multimodal checkpoint's `model.language_model.<x>` as the text model's `model.<x>`;
    other names (the vision tower's, lm_head) as they are."""
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return "model." + name.removeprefix(LANGUAGE_MODEL_PREFIX)
    return name


def qwen3_5_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's switches with Qwen3.5's MLPs: dense (`qwen3_5_text`), or experts and a
    gated shared expert on every layer, renormalised top k (`qwen3_5_moe_text`)."""
    fields = qwen3_next_fields(raw)
    if raw.get("model_type") == QWEN3_5_TEXT:
        return {**fields, "shared_expert_intermediate_size": 0, "shared_expert_gate": False}
    num_experts = raw.get("num_experts") or 0
    return {
        **fields,
        "sparse_layers": (num_experts > 0,) * raw["num_hidden_layers"],
        "norm_topk_prob": True,
    }


def _moe_text_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """`qwen3_5_moe_text` has no intermediate_size (every layer is MoE): the experts' width
    stands in for it, so the common fields read; others as they are."""
    if raw.get("model_type") != QWEN3_5_MOE_TEXT or "intermediate_size" in raw:
        return raw
    return {**raw, "intermediate_size": raw.get("moe_intermediate_size", 0)}
