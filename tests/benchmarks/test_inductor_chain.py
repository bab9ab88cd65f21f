"""benchmarks/inductor_chain.py compares like with like: its plain-torch chain (what inductor
compiles) computes what kvpager's DecoderLayer.forward computes, on a tiny model, uncompiled."""

import torch
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops

from benchmarks.engine.inductor_chain import TorchChain, build_layers, kvpager_chain, step_inputs


@torch.inference_mode()
def test_the_torch_chain_matches_kvpagers_decoder_layers(tiny_llama):
    torch.manual_seed(0)
    config = ModelConfig.from_path(tiny_llama)
    ops = get_kernel_ops("cpu")
    layers = build_layers(config, torch.float32, ops)
    chain = TorchChain(layers).eval()
    for layer in layers:
        layer.build_matmuls(pack=True)
    x, cos, sin = step_inputs(5, config, torch.float32)
    theirs = chain(x, cos, sin)
    ours = kvpager_chain(layers, x.clone(), cos, sin)
    for a, b in zip(theirs, ours, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert theirs[1].abs().max() > 0  # the chain did run: the last MLP output is not zero
