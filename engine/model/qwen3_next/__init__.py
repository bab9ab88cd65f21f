"""Qwen3-Next's layer pieces: the gated DeltaNet mixer, gated attention, the shared-expert MoE."""
