"""Mamba2's recurrence: the causal depthwise conv1d and the selective state-space scan, per
sequence, reading and updating the sequence's recurrent state in place.

Shapes, for one sequence of T tokens: x [T, H, P] (H heads of P channels), dt [T, H] after
dt_bias, softplus and the time-step limit, A [H] (negative: -exp(A_log)), B and C [T, G, N]
(G groups, each shared by H / G heads, N = d_state), D [H]. The SSM state is [H, P, N] and
evolves per token as state = exp(dt * A) * state + dt * x ⊗ B; the output is state · C + D * x.

Two forms compute it. `ssm_scan_sequential` steps token by token: the reference. The chunked
form (state space duality, SSD, as in Mamba2 and transformers' torch path) computes each chunk
of `chunk_size` tokens as a masked matmul and carries the state only across chunk edges:
the prefill kernel, tested against the reference (tests/kernels/test_mamba2_scan.py). Decode
is `ssm_step`: one token for each of S sequences at once, each with its own state.
The scan runs in float32 whatever the model's dtype, as transformers' does.
"""

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The depthwise causal conv1d of x [T, C] (kernel K) after the K - 1 inputs held in
    `conv_state` [C, K - 1] (zeros for a new sequence), then SiLU; `conv_state` becomes the last
    K - 1 inputs. One form for prefill chunks and decode steps."""
    num_tokens, kernel = x.shape[0], weight.shape[-1]
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + T]
    conv_state.copy_(window[:, -(kernel - 1) :])
    out = F.conv1d(
        window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=x.shape[1]
    )
    return F.silu(out[0, :, -num_tokens:].t()).to(x.dtype)


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C [..., G, N] per head: [..., H, N] (each group serves H / G heads)."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssm_scan_sequential(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The reference: token by token. Returns y [T, H, P] (float32); `state` is updated."""
    num_heads = x.shape[1]
    B, C, x, dt = _heads(B, num_heads), _heads(C, num_heads), x.float(), dt.float()
    h = state.float()
    out = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A.float())[:, None, None]
        h = decay * h + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        out.append(torch.einsum("hpn,hn->hp", h, C[t]) + D.float()[:, None] * x[t])
    state.copy_(h)
    return torch.stack(out) if out else x.new_zeros(x.shape)


def ssm_scan_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """The prefill form: within a chunk, y = (C Bᵀ ∘ decay mask) (dt x) plus the chunk's start
    state read through C; across chunks only the state travels. Equal to the reference up to
    float rounding. Returns y [T, H, P] (float32); `state` is updated."""
    num_tokens, num_heads, _ = x.shape
    if num_tokens == 0:
        return x.float()
    B, C, xf = _heads(B, num_heads), _heads(C, num_heads), x.float()
    a = dt.float() * A.float()  # [T, H]: log of each token's decay
    xdt = xf * dt.float()[..., None]
    h = state.float()
    out = []
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        cum = torch.cumsum(a[start:end], dim=0)  # [L, H]
        # decay from token s to token l (s <= l): exp(cum[l] - cum[s]); above the diagonal 0
        seg = cum[:, None, :] - cum[None, :, :]  # [L, S, H]
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        mask = torch.exp(seg.masked_fill(~causal[..., None], float("-inf")))
        scores = torch.einsum("lhn,shn->lsh", C[start:end], B[start:end]) * mask
        y = torch.einsum("lsh,shp->lhp", scores, xdt[start:end])
        y += torch.einsum("lhn,hpn->lhp", C[start:end], h) * torch.exp(cum)[..., None]
        to_end = torch.exp(cum[-1] - cum)  # [L, H]: decay from each token to the chunk's end
        h = torch.exp(cum[-1])[:, None, None] * h + torch.einsum(
            "lh,lhp,lhn->hpn", to_end, xdt[start:end], B[start:end]
        )
        out.append(y)
    state.copy_(h)
    return torch.cat(out) + D.float()[:, None] * xf


def ssm_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """Decode: one token for each of S sequences. x [S, H, P], dt [S, H], B and C [S, G, N],
    states [S, H, P, N] (each sequence's own, updated). Returns y [S, H, P] (float32)."""
    num_heads = x.shape[1]
    B, C, xf, dt = _heads(B, num_heads), _heads(C, num_heads), x.float(), dt.float()
    decay = torch.exp(dt * A.float())[..., None, None]
    h = decay * states.float() + (dt[..., None] * xf)[..., None] * B[:, :, None, :]
    states.copy_(h)
    return torch.einsum("shpn,shn->shp", h, C) + D.float()[:, None] * xf


def causal_conv1d_step(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Decode: one token x [S, C] for each of S sequences, sequence i after the K - 1 inputs
    in conv_states[slots[i]] ([slots, C, K - 1], updated), then SiLU. Returns [S, C]. As
    F.conv1d: the K products summed in float32, rounded once to the weight's dtype."""
    window = torch.cat([conv_states[slots], x[:, :, None].to(conv_states.dtype)], dim=-1)
    conv_states[slots] = window[:, :, 1:]
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return F.silu(out.to(weight.dtype)).to(x.dtype)


def ssm_scan_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """A flat batch token by token: sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] and
    reads and updates states[slots[i]] ([slots, H, P, N]). Returns y [T, H, P] (float32).
    The twin of kernels/mamba2_triton.py's ssm_scan_varlen."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        rows = slice(bounds[i], bounds[i + 1])
        out[rows] = ssm_scan_sequential(x[rows], dt[rows], A, B[rows], C[rows], D, states[slot])
    return out


def ssm_step_slots_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`ssm_step` with sequence i on states[slots[i]] ([slots, H, P, N], updated in place):
    the twin of the decode kernels (kernels/mamba2_triton.py, kernels/cpu_mamba2.py)."""
    seq_states = states[slots]
    out = ssm_step(x, dt, A, B, C, D, seq_states)
    states[slots] = seq_states.to(states.dtype)
    return out
