"""The gated delta rule token by token: the torch twin of kernels/gated_delta_rule.py (the
chunked prefill form and the decode step) and of kernels/gated_delta_rule_triton.py.

Shapes, for one sequence of T tokens: q, k [T, Hk, K] (as `normalise_qk` leaves them: both
L2-normalised, q also scaled by K^-0.5), v [T, H, V], g [T, H] (the log of each token's decay,
<= 0), beta [T, H] (each token's write strength, in (0, 1)); each of the Hk key heads serves
H / Hk consecutive value heads (Qwen3-Next's grouped value heads). The state is [H, K, V] in
float32 and evolves per token as

    S = exp(g) S;   S = S + k ⊗ beta (v - kᵀ S);   o = qᵀ S

(the delta rule: what the state already predicts for k is replaced, not added to).
"""

import torch


def per_value_head(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q or k [..., Hk, K] per value head: [..., H, K] in float32."""
    return x.float().repeat_interleave(num_heads // x.shape[-2], dim=-2)


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One sequence, token by token. Returns o [T, H, V] (float32); `state` is updated."""
    num_heads = v.shape[1]
    q, k = per_value_head(q, num_heads), per_value_head(k, num_heads)
    v, g, beta = v.float(), g.float(), beta.float()
    h = state.float()
    out = []
    for t in range(v.shape[0]):
        h = h * torch.exp(g[t])[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], h)
        h = h + k[t][:, :, None] * (beta[t][:, None] * (v[t] - predicted))[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], h))
    state.copy_(h)
    return torch.stack(out) if out else v.new_zeros(v.shape)


def gated_delta_rule_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """A flat batch: sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] (a prefill chunk or
    one decode token) and reads and updates states[slots[i]] (states [slots, H, K, V]).
    Returns o [T, H, V] (float32)."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        rows = slice(bounds[i], bounds[i + 1])
        args = (q[rows], k[rows], v[rows], g[rows], beta[rows])
        out[rows] = gated_delta_rule_ref(*args, states[slot])
    return out
