"""The gated delta rule (Qwen3-Next's gated DeltaNet layers) in torch: the chunked form for
prefill and one step for decode, reading and updating each sequence's state in place.
Shapes and the recurrence: kernels/gated_delta_rule_ref.py, the token-by-token twin both are
tested against (tests/kernels/test_gated_delta_rule.py).

The chunked form (the WY / UT transform of DeltaNet, as transformers' torch path and
flash-linear-attention compute it) turns each chunk of `chunk_size` tokens into a few
matmuls and one unit-lower-triangular solve; only the state crosses chunk edges. A chunk that
ends early needs no padding: the zeros transformers pads with neither decay nor write.
Everything runs in float32, as transformers' does.
"""

import torch
from kvpager.kernels.gated_delta_rule_ref import per_value_head

L2_EPS = 1e-6  # flash-linear-attention's and transformers' l2norm


def normalise_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., K] -> float32 x * rsqrt(sum(x²) + eps), q also times K^-0.5 (the rule's
    inputs; transformers' use_qk_l2norm_in_kernel)."""

    def l2(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)

    return l2(q) * q.shape[-1] ** -0.5, l2(k)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """One sequence's prefill (or prefill chunk) from `state` [H, K, V]. Returns o [T, H, V]
    (float32); `state` is updated. Equal to gated_delta_rule_ref up to float rounding."""
    num_tokens, num_heads = v.shape[:2]
    # [H, T, ...]: heads first, so each chunk is a batch of per-head matmuls
    q, k = (per_value_head(x, num_heads).transpose(0, 1) for x in (q, k))
    v, g, beta = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    h = state.float()
    out = []
    for start in range(0, num_tokens, chunk_size):
        rows = slice(start, min(start + chunk_size, num_tokens))
        o, h = _chunk(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows], h)
        out.append(o)
    state.copy_(h)
    if not out:
        return v.transpose(0, 1).clone()
    return torch.cat(out, dim=1).transpose(0, 1)


def _chunk(q, k, v, g, beta, h) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens, per head: q, k [H, L, K], v [H, L, V], g, beta [H, L], the
    state h [H, K, V] at its start. Returns (o [H, L, V], the state at its end)."""
    length = g.shape[1]
    cum = torch.cumsum(g, dim=1)  # [H, L]: log of the decay from the chunk's start
    # decay from token s to token l (s <= l): exp(cum[l] - cum[s]); above the diagonal 0
    causal = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    diff = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf"))
    decay = torch.exp(diff)  # [H, L, L]
    k_beta = k * beta[..., None]
    # each token's write corrected for the earlier writes of the chunk: (I + strict lower
    # part of (k_beta kᵀ ∘ decay))⁻¹, applied to v_beta and to the decayed k_beta
    system = (k_beta @ k.transpose(-1, -2)) * decay
    solve = dict(upper=False, unitriangular=True)
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], **solve)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * torch.exp(cum)[..., None], **solve)
    v_new = new_values - k_cumdecay @ h  # [H, L, V]
    o = (q * torch.exp(cum)[..., None]) @ h + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    to_end = torch.exp(cum[:, -1:] - cum)[..., None]  # [H, L, 1]: decay to the chunk's end
    h = h * torch.exp(cum[:, -1])[:, None, None] + (k * to_end).transpose(-1, -2) @ v_new
    return o, h


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """Decode: one token for each of S sequences. q, k [S, Hk, K], v [S, H, V], g, beta
    [S, H], states [S, H, K, V] (each sequence's own, updated). Returns o [S, H, V] (float32)."""
    num_heads = v.shape[1]
    q, k = per_value_head(q, num_heads), per_value_head(k, num_heads)
    h = states.float() * torch.exp(g.float())[..., None, None]
    predicted = torch.einsum("shk,shkv->shv", k, h)
    delta = beta.float()[..., None] * (v.float() - predicted)
    h = h + k[..., None] * delta[..., None, :]
    states.copy_(h)
    return torch.einsum("shk,shkv->shv", q, h)
