"""The Mamba2 mixer on its Triton kernels (TRITON_INTERPRET=1 on CPU: the path it takes on
CUDA) equals transformers' layer over sequences prefilled in chunks and decoded together in
slots out of order. (On CPU its decode steps run the C state update, kernels/cpu_mamba2.py:
tests/engine/model/test_mamba2.py covers that path.)"""

import pytest
import torch
from kvpager.engine.model.mamba2 import RecurrentStates

from tests.engine.model.recurrent_steps import run_in_steps
from tests.engine.model.test_mamba2 import HIDDEN, hf_layer, ours, reference


def test_triton_chunked_prefill_and_decode_equal_transformers():
    pytest.importorskip("triton")
    layer = hf_layer(3)
    mixer = ours(layer)
    mixer.triton = True
    lengths, slots, prompt_lens = [9, 4, 6], [3, 0, 1], [7, 2, 1]
    seqs = [torch.randn(n, HIDDEN) for n in lengths]
    states = RecurrentStates.allocate(mixer.dims, 1, 4, torch.float32, "cpu")
    outputs = run_in_steps(mixer, seqs, slots, prompt_lens, states, chunk=4)
    for output, seq in zip(outputs, seqs):
        torch.testing.assert_close(output, reference(layer, seq), rtol=1e-4, atol=1e-4)
    assert not states.ssm[0, 2].any() and not states.conv[0, 2].any()  # the free slot
