"""Mamba2's recurrence in Triton, over state slots: the chunked scan (SSD) for a flat batch of
prefill chunks, and the decode step (the conv1d window roll, then the SSM state update) for a
batch of sequences each on its own slot (mamba_ssm's `mamba_chunk_scan_combined` and
`selective_state_update`, with vLLM's state indices).

The scan: one program per (sequence, head, block of BLOCK_P head channels) holds its
[BLOCK_P, N] slice of the state in registers and walks the sequence a chunk of CHUNK tokens
at a time: within a chunk y = (C Bᵀ ∘ decay mask) (dt x) plus the chunk's start state read
through C; only the state crosses chunk edges (kernels/mamba2_scan.py says the maths). The
padding rows past a sequence's end load dt = 0 and x = 0: they neither decay nor write.

Twins (kernels/mamba2_scan.py): ssm_scan_varlen_ref, ssm_step_slots_ref and
causal_conv1d_step, tested under TRITON_INTERPRET=1 on CPU (tests/kernels/test_mamba2_triton.py)
and compiled for sm_90 there. Float32 maths whatever the inputs' dtype, as the twins.
"""

import torch
import triton
import triton.language as tl

# Tokens a chunk of the scan: at Mamba2's 64 x 128 heads, 64-token chunks compiled for sm_90
# with twice the spills of 32 (ptxas: 11 KB of stack against 6 KB). Not tuned on a device.
CHUNK_SIZE = 32


@triton.jit
def state_tile(state_ptr, slot, head, rows, cols, num_rows, num_cols, stride_slot, stride_head,
               stride_row):  # fmt: skip
    """The pointers and mask of one head's [rows, cols] tile of a slot's state
    ([slots, heads, num_rows, num_cols], columns dense): Mamba2's and the chunked DeltaNet's."""
    offs = slot * stride_slot + head * stride_head + rows[:, None] * stride_row + cols[None, :]
    return state_ptr + offs, (rows < num_rows)[:, None] & (cols < num_cols)[None, :]


@triton.jit
def _ssm_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, out_ptr, state_ptr, cu_seqlens_ptr, slots_ptr,
    stride_x_tok, stride_x_head, stride_dt_tok, stride_b_tok, stride_b_group, stride_c_tok,
    stride_c_group, stride_out_tok, stride_out_head, stride_state_slot, stride_state_head,
    stride_state_p,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq, head, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    group = head // HEADS_PER_GROUP
    offs_l = tl.arange(0, CHUNK)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    states, state_mask = state_tile(
        state_ptr, slot, head, offs_p, offs_n, P, N, stride_state_slot, stride_state_head,
        stride_state_p,
    )  # fmt: skip
    h = tl.load(states, mask=state_mask, other=0.0).to(tl.float32)  # [BP, BN]
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)
    causal = offs_l[:, None] >= offs_l[None, :]
    for chunk_start in range(start, end, CHUNK):
        rows = chunk_start + offs_l
        mask_l = rows < end
        x_offs = rows[:, None] * stride_x_tok + head * stride_x_head + offs_p[None, :]
        x = tl.load(x_ptr + x_offs, mask=mask_l[:, None] & mask_p[None, :], other=0.0)
        x = x.to(tl.float32)  # [L, BP]
        dt = tl.load(dt_ptr + rows * stride_dt_tok + head, mask=mask_l, other=0.0).to(tl.float32)
        bc_mask = mask_l[:, None] & mask_n[None, :]
        b_offs = rows[:, None] * stride_b_tok + group * stride_b_group + offs_n[None, :]
        bm = tl.load(b_ptr + b_offs, mask=bc_mask, other=0.0).to(tl.float32)  # [L, BN]
        c_offs = rows[:, None] * stride_c_tok + group * stride_c_group + offs_n[None, :]
        cm = tl.load(c_ptr + c_offs, mask=bc_mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(dt * a, 0)  # [L]: log of the decay from the chunk's start
        total = tl.sum(dt * a, 0)  # the padding adds nothing: the decay over the whole chunk
        # decay from token s to token l (s <= l): exp(cum[l] - cum[s]); above the diagonal 0
        seg = tl.where(causal, cum[:, None] - cum[None, :], float("-inf"))
        scores = tl.dot(cm, tl.trans(bm), input_precision="ieee") * tl.exp(seg) * dt[None, :]
        y = tl.dot(scores, x, input_precision="ieee")
        y += tl.dot(cm, tl.trans(h), input_precision="ieee") * tl.exp(cum)[:, None]
        y += d * x
        out_offs = rows[:, None] * stride_out_tok + head * stride_out_head + offs_p[None, :]
        tl.store(out_ptr + out_offs, y, mask=mask_l[:, None] & mask_p[None, :])
        to_end = dt * tl.exp(total - cum)  # [L]: each write decayed to the chunk's end
        h = h * tl.exp(total) + tl.dot(tl.trans(x * to_end[:, None]), bm, input_precision="ieee")
    tl.store(states, h.to(state_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def _ssm_step_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, out_ptr, state_ptr, slots_ptr,
    stride_x_seq, stride_x_head, stride_dt_seq, stride_b_seq, stride_b_group, stride_c_seq,
    stride_c_group, stride_out_seq, stride_out_head, stride_state_slot, stride_state_head,
    stride_state_p,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq, head, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    group = head // HEADS_PER_GROUP
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    states, state_mask = state_tile(
        state_ptr, slot, head, offs_p, offs_n, P, N, stride_state_slot, stride_state_head,
        stride_state_p,
    )  # fmt: skip
    h = tl.load(states, mask=state_mask, other=0.0).to(tl.float32)  # [BP, BN]
    x_offs = seq * stride_x_seq + head * stride_x_head + offs_p
    x = tl.load(x_ptr + x_offs, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + seq * stride_dt_seq + head).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)
    b_offs = seq * stride_b_seq + group * stride_b_group + offs_n
    bv = tl.load(b_ptr + b_offs, mask=mask_n, other=0.0).to(tl.float32)
    c_offs = seq * stride_c_seq + group * stride_c_group + offs_n
    cv = tl.load(c_ptr + c_offs, mask=mask_n, other=0.0).to(tl.float32)
    h = h * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
    y = tl.sum(h * cv[None, :], axis=1) + d * x
    out_offs = seq * stride_out_seq + head * stride_out_head + offs_p
    tl.store(out_ptr + out_offs, y, mask=mask_p)
    tl.store(states, h.to(state_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def _conv_step_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, state_ptr, slots_ptr,
    stride_x_seq, stride_out_seq, stride_state_slot, stride_state_chan, num_channels,
    KERNEL: tl.constexpr, KERNEL_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    seq, pid_c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, KERNEL_PAD)
    mask_c = offs_c < num_channels
    held = KERNEL - 1  # the inputs a slot holds
    x = tl.load(x_ptr + seq * stride_x_seq + offs_c, mask=mask_c, other=0.0)
    x = x.to(state_ptr.dtype.element_ty)  # the window holds the state's dtype (the twin's)
    row = state_ptr + slot * stride_state_slot + offs_c[:, None] * stride_state_chan
    # [BC, KP]: the held inputs then x; shifted: the slot's next contents (one input on)
    window = tl.load(row + offs_k[None, :], mask=mask_c[:, None] & (offs_k < held)[None, :])
    window = tl.where((offs_k == held)[None, :], x[:, None], window)
    shifted = tl.load(
        row + offs_k[None, :] + 1, mask=mask_c[:, None] & (offs_k + 1 < held)[None, :]
    )
    shifted = tl.where((offs_k + 1 == held)[None, :], x[:, None], shifted)
    weight_offs = offs_c[:, None] * KERNEL + offs_k[None, :]
    weight_mask = mask_c[:, None] & (offs_k < KERNEL)[None, :]
    weight = tl.load(weight_ptr + weight_offs, mask=weight_mask, other=0.0)
    out = tl.sum(tl.where(weight_mask, window.to(tl.float32), 0.0) * weight.to(tl.float32), 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    out = out.to(weight_ptr.dtype.element_ty).to(tl.float32)  # rounded once, as F.conv1d
    out = out * tl.sigmoid(out)
    tl.store(out_ptr + seq * stride_out_seq + offs_c, out.to(out_ptr.dtype.element_ty), mask=mask_c)
    tl.store(row + offs_k[None, :], shifted, mask=mask_c[:, None] & (offs_k < held)[None, :])


def _blocks(head_dim: int, state_size: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N): tl.dot wants every side at least 16 on the device."""
    return max(16, min(triton.next_power_of_2(head_dim), 32)), max(
        16, triton.next_power_of_2(state_size)
    )


def _check(x: torch.Tensor, B: torch.Tensor, states: torch.Tensor) -> None:
    assert x.shape[1] % B.shape[1] == 0, "heads must be a multiple of groups"
    assert states.is_contiguous(), "the state slots must be contiguous"
    assert states.shape[1:] == (x.shape[1], x.shape[2], B.shape[2]), "state shape"


def _last_dim_dense(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def ssm_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The chunked scan of a flat batch: x [T, H, P], dt [T, H] (after bias, softplus and
    limit), A, D [H], B, C [T, G, N]; sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] and
    starts from states[slots[i]] ([slots, H, P, N], updated in place). Returns y [T, H, P]
    float32 (D's skip included), as ssm_scan_varlen_ref."""
    _check(x, B, states)
    num_tokens, num_heads, head_dim = x.shape
    x, dt, B, C = _last_dim_dense(x, dt, B, C)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or slots.shape[0] == 0:
        return out
    block_p, block_n = _blocks(head_dim, B.shape[2])
    grid = (slots.shape[0], num_heads, triton.cdiv(head_dim, block_p))
    _ssm_scan_kernel[grid](
        x, dt, A.float().contiguous(), B, C, D.float().contiguous(), out, states, cu_seqlens,
        slots, x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), out.stride(0), out.stride(1), states.stride(0), states.stride(1),
        states.stride(2), HEADS_PER_GROUP=num_heads // B.shape[1], P=head_dim, N=B.shape[2],
        CHUNK=max(16, triton.next_power_of_2(chunk_size)), BLOCK_P=block_p, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def ssm_step_slots(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Decode: one token for each of S sequences, x [S, H, P], dt [S, H], B, C [S, G, N],
    sequence i on states[slots[i]] ([slots, H, P, N], updated in place). Returns y [S, H, P]
    float32, as ssm_step_slots_ref."""
    _check(x, B, states)
    num_seqs, num_heads, head_dim = x.shape
    x, dt, B, C = _last_dim_dense(x, dt, B, C)
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=x.device)
    if num_seqs == 0:
        return out
    block_p, block_n = _blocks(head_dim, B.shape[2])
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
    _ssm_step_kernel[grid](
        x, dt, A.float().contiguous(), B, C, D.float().contiguous(), out, states, slots,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), out.stride(0), out.stride(1), states.stride(0), states.stride(1),
        states.stride(2), HEADS_PER_GROUP=num_heads // B.shape[1], P=head_dim, N=B.shape[2],
        BLOCK_P=block_p, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def causal_conv1d_step_triton(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Decode's conv1d: kernels/mamba2_scan.py's causal_conv1d_step (x [S, C], conv_states
    [slots, C, K - 1] rolled in place, weight [C, K]); returns SiLU of it, [S, C] in x's dtype."""
    num_seqs, num_channels = x.shape
    kernel = weight.shape[-1]
    assert conv_states.shape[1:] == (num_channels, kernel - 1), "conv state shape"
    assert conv_states.stride(-1) == 1, "conv state rows must be dense"
    x, weight = _last_dim_dense(x, weight.contiguous())
    out = torch.empty_like(x)
    if num_seqs == 0:
        return out
    block_c = min(triton.next_power_of_2(num_channels), 256)
    grid = (num_seqs, triton.cdiv(num_channels, block_c))
    _conv_step_kernel[grid](
        x, weight, weight if bias is None else bias, out, conv_states, slots, x.stride(0),
        out.stride(0), conv_states.stride(0), conv_states.stride(1), num_channels,
        KERNEL=kernel, KERNEL_PAD=triton.next_power_of_2(kernel), HAS_BIAS=bias is not None,
        BLOCK_C=block_c,
    )  # fmt: skip
    return out
