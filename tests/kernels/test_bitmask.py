"""The token bitmask apply against its token-by-token twin, on awkward shapes."""

import pytest
import torch
from kvpager.kernels.bitmask import apply_token_bitmask
from kvpager.kernels.reference import apply_token_bitmask_ref


@pytest.mark.parametrize(
    ("num_rows", "vocab", "rows"), [(1, 1, [0]), (3, 70, [2, 0]), (4, 96, [1, 2, 3])]
)
def test_apply_matches_reference(num_rows: int, vocab: int, rows: list[int]) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(num_rows, vocab, generator=generator)
    num_words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), num_words), generator=generator)
    bitmask = bitmask.to(torch.int32)
    bitmask[-1, 0] |= 1  # the sign bit and bit 0 both in play
    rows_t = torch.tensor(rows)
    fast, slow = logits.clone(), logits.clone()
    apply_token_bitmask(fast, bitmask, rows_t)
    apply_token_bitmask_ref(slow, bitmask, rows_t)
    assert torch.equal(fast, slow)
    untouched = [r for r in range(num_rows) if r not in rows]
    assert torch.equal(fast[untouched], logits[untouched])


def test_one_allowed_token() -> None:
    logits = torch.zeros(1, 40)
    bitmask = torch.tensor([[0, 1 << 3]], dtype=torch.int32)  # token 35 only
    apply_token_bitmask(logits, bitmask, torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [35]
