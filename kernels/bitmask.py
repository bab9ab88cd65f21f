"""Applying a grammar's token bitmask to logits before sampling (structured outputs).

    bitmask int32 [num_masked, ceil(vocab / 32)]: bit i of word w set = token 32 * w + i allowed
    logits  float [num_rows, vocab], rows[j] = the logits row that mask j applies to

One vectorised unpack and a masked fill: on CPU that is a small fraction of a decode step even at a
49,152-token vocabulary, so no fused Triton or C kernel earns its place (vLLM's Triton apply pays
off at large batches on GPU). Its twin, `apply_token_bitmask_ref` in kernels/reference.py, tests it
token by token.
"""

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[j], t] = -inf wherever bit t of bitmask[j] is clear.

    `rows` int64 [num_masked] on the logits' device; `bitmask` int32, any device. Tokens past
    32 * words (none, for a mask sized to the vocabulary) stay as they are.
    """
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2, "bitmask: int32 [rows, words]"
    assert logits.dim() == 2 and rows.numel() == bitmask.shape[0], "one mask per row"
    vocab = logits.shape[1]
    bitmask = bitmask.to(logits.device)
    # [num_masked, words, 32] -> [num_masked, words * 32]: bit i of word w is token 32 * w + i
    allowed = ((bitmask.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).bool().flatten(1)
    allowed = allowed[:, :vocab]
    width = allowed.shape[1]
    selected = logits[rows, :width]
    logits[rows, :width] = selected.masked_fill(~allowed, float("-inf"))
