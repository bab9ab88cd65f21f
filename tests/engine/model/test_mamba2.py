"""The Mamba2 mixer equals transformers' GraniteMoeHybridMambaLayer in fp32: over whole
prompts, and over several sequences of different lengths batched together, each prefilled in
small chunks and then decoded token by token in its own state slot (slots out of order, a
forked slot copied). The layer's output for each token is the same however it was split."""

import torch
from kvpager.engine.model.mamba2 import Mamba2Dims, Mamba2Mixer, RecurrentStates
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)

from tests.engine.model.recurrent_steps import run_in_steps

HIDDEN = 16


def hf_layer(seed: int = 0) -> GraniteMoeHybridMambaLayer:
    config = GraniteMoeHybridConfig(
        hidden_size=HIDDEN,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=6,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=4,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        num_hidden_layers=1,
        layer_types=["mamba"],
    )
    torch.manual_seed(seed)
    layer = GraniteMoeHybridMambaLayer(config, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        layer.A_log.copy_(torch.rand(4).log())
        layer.dt_bias.copy_(torch.randn(4) * 0.3)
    return layer


def ours(layer: GraniteMoeHybridMambaLayer) -> Mamba2Mixer:
    dims = Mamba2Dims(
        hidden_size=HIDDEN,
        num_heads=layer.num_heads,
        head_dim=layer.head_dim,
        num_groups=layer.n_groups,
        state_size=layer.ssm_state_size,
        conv_kernel=layer.conv_kernel_size,
        chunk_size=layer.chunk_size,
        eps=layer.layer_norm_epsilon,
    )
    mixer = Mamba2Mixer(dims, torch.float32, bias=False, conv_bias=True)
    with torch.no_grad():
        mixer.in_proj.copy_(layer.in_proj.weight)
        mixer.conv_weight.copy_(layer.conv1d.weight[:, 0])
        mixer.conv_bias.copy_(layer.conv1d.bias)
        for name in ("dt_bias", "A_log", "D"):
            getattr(mixer, name).copy_(getattr(layer, name))
        mixer.norm_weight.copy_(layer.norm.weight)
        mixer.out_proj.copy_(layer.out_proj.weight)
    return mixer


def reference(layer, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(prompt[None])[0]


def test_whole_prompts_equal_transformers():
    layer = hf_layer()
    mixer = ours(layer)
    prompts = [torch.randn(n, HIDDEN) for n in (1, 5, 11)]
    states = RecurrentStates.allocate(mixer.dims, 1, 3, torch.float32, "cpu")
    out = mixer(torch.cat(prompts[1:]), [5, 11], [2, 0], states.conv[0], states.ssm[0])
    expected = torch.cat([reference(layer, p) for p in prompts[1:]])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert not states.ssm[0, 1].any()  # the free slot untouched


def test_chunked_prefill_and_decode_batched_equal_transformers():
    """Three sequences, different lengths: prefill in chunks of 3, then decode steps, all
    in one batch each step (some prefilling while others decode)."""
    layer = hf_layer(1)
    mixer = ours(layer)
    lengths, slots, prompt_lens = [14, 4, 9], [3, 0, 1], [7, 2, 1]
    seqs = [torch.randn(n, HIDDEN) for n in lengths]
    states = RecurrentStates.allocate(mixer.dims, 1, 4, torch.float32, "cpu")
    outputs = run_in_steps(mixer, seqs, slots, prompt_lens, states)
    for output, seq in zip(outputs, seqs):
        torch.testing.assert_close(output, reference(layer, seq), rtol=1e-4, atol=1e-4)


def test_fork_copies_state():
    layer = hf_layer(2)
    mixer = ours(layer)
    prompt, tail = torch.randn(6, HIDDEN), torch.randn(2, HIDDEN)
    states = RecurrentStates.allocate(mixer.dims, 1, 2, torch.float32, "cpu")
    mixer(prompt, [6], [0], states.conv[0], states.ssm[0])
    states.copy([(0, 1)])
    parent = mixer(tail[:1], [1], [0], states.conv[0], states.ssm[0])
    child = mixer(tail[:1], [1], [1], states.conv[0], states.ssm[0])
    torch.testing.assert_close(parent, child)
    expected = reference(layer, torch.cat([prompt, tail[:1]]))[-1:]
    torch.testing.assert_close(child, expected, rtol=1e-4, atol=1e-4)
    states.reset([1])
    assert not states.conv[:, 1].any() and not states.ssm[:, 1].any()


def test_dims_read_from_the_config_are_the_layers():
    """engine/mamba2_config.py reads transformers' own config as its layer does."""
    from kvpager.engine.mamba2_config import mamba2_dims, mamba_layers

    config = GraniteMoeHybridConfig(
        hidden_size=HIDDEN,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=6,
        mamba_chunk_size=4,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
    )
    raw = {**config.to_dict(), "model_type": "granitemoehybrid"}
    layer = GraniteMoeHybridMambaLayer(config, 0)
    assert mamba2_dims(raw) == ours(layer).dims
    assert mamba_layers(raw) == [True, False, True]
