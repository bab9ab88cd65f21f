"""The gated DeltaNet mixer equals transformers' Qwen3NextGatedDeltaNet in fp32: over whole
prompts, and over several sequences of different lengths batched together, each prefilled in
small chunks and then decoded token by token in its own state slot (slots out of order, a
forked slot copied), on the torch forms and on the Triton kernel (TRITON_INTERPRET=1 on CPU);
in bf16 it follows transformers' bf16 layer. Each token's output is the same however it was
split."""

import pytest
import torch
from kvpager.engine.families.qwen3_next import DeltaNetDims, deltanet_dims, deltanet_layers
from kvpager.engine.model.qwen3_next.gated_deltanet import GatedDeltaNet, allocate_states
from kvpager.schemas.errors import CheckpointError
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from tests.engine.model.recurrent_steps import run_in_steps

HIDDEN = 16


def hf_config(**overrides) -> Qwen3NextConfig:
    fields = dict(
        hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    return Qwen3NextConfig(**{**fields, **overrides})


def hf_layer(seed: int = 0) -> Qwen3NextGatedDeltaNet:
    torch.manual_seed(seed)
    layer = Qwen3NextGatedDeltaNet(hf_config(), 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        layer.A_log.copy_(torch.rand(4).log())
        layer.norm.weight.copy_(1 + torch.randn(6) * 0.1)
    return layer


def ours(layer: Qwen3NextGatedDeltaNet, chunk_size: int = 4, triton=None) -> GatedDeltaNet:
    raw = {**hf_config().to_dict(), "model_type": "qwen3_next"}
    dims = deltanet_dims(raw)
    dims = DeltaNetDims(**{**dims.__dict__, "chunk_size": chunk_size})
    mixer = GatedDeltaNet(dims, torch.float32, triton)
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():
            mixer.load_tensor(name, tensor)
    return mixer


def reference(layer, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(prompt[None])[0]


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_whole_prompts_equal_transformers(chunk_size):
    layer = hf_layer()
    mixer = ours(layer, chunk_size)
    prompts = [torch.randn(n, HIDDEN) for n in (5, 11)]
    states = allocate_states(mixer.dims, 1, 3, torch.float32, "cpu")
    out = mixer(torch.cat(prompts), [5, 11], [2, 0], states.conv[0], states.ssm[0])
    expected = torch.cat([reference(layer, p) for p in prompts])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert not states.ssm[0, 1].any() and not states.conv[0, 1].any()  # the free slot


@pytest.mark.parametrize("triton", [False, True])
def test_chunked_prefill_and_decode_batched_equal_transformers(triton):
    """Three sequences, different lengths: prefill in chunks of 3, then decode steps, all
    in one batch each step (some prefilling while others decode)."""
    if triton:
        pytest.importorskip("triton")
    layer = hf_layer(1)
    mixer = ours(layer, triton=triton)
    lengths, slots, prompt_lens = [14, 4, 9], [3, 0, 1], [7, 2, 1]
    seqs = [torch.randn(n, HIDDEN) for n in lengths]
    states = allocate_states(mixer.dims, 1, 4, torch.float32, "cpu")
    outputs = run_in_steps(mixer, seqs, slots, prompt_lens, states)
    for output, seq in zip(outputs, seqs):
        torch.testing.assert_close(output, reference(layer, seq), rtol=1e-4, atol=1e-4)


def test_bf16_follows_transformers_bf16():
    """In bf16 (conv state in bf16, the rule's in float32): chunked prefill and batched decode
    follow transformers' bf16 layer over whole prompts within a bf16 step (on this host they
    were equal bit for bit)."""
    layer = hf_layer(1)
    dims = ours(layer, chunk_size=64).dims
    layer = layer.bfloat16()
    mixer = GatedDeltaNet(dims, torch.bfloat16)
    for name, tensor in layer.state_dict().items():
        mixer.load_tensor(name, tensor)
    seqs = [torch.randn(n, HIDDEN).bfloat16() for n in (14, 4, 9)]
    states = allocate_states(dims, 1, 4, torch.bfloat16, "cpu")
    outputs = run_in_steps(mixer, seqs, [3, 0, 1], [7, 2, 1], states)
    for output, seq in zip(outputs, seqs):
        assert output.dtype == torch.bfloat16
        torch.testing.assert_close(output, reference(layer, seq), rtol=1.6e-2, atol=3e-2)


def test_qwen3_5_layer_equals_transformers():
    """Qwen3.5's layer (`qwen3_5` text): the same mixer, its projections kept apart in the
    checkpoint (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and loaded into the same rows."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    fields = {k: v for k, v in hf_config().to_dict().items() if k.startswith("linear_")}
    config = Qwen3_5TextConfig(hidden_size=HIDDEN, num_hidden_layers=1,
                               layer_types=["linear_attention"], **fields)  # fmt: skip
    torch.manual_seed(4)
    layer = Qwen3_5GatedDeltaNet(config, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        layer.A_log.copy_(torch.rand(4).log())
    mixer = ours(hf_layer())  # Qwen3-Next's geometry is the same: reload the weights
    for name, tensor in layer.state_dict().items():
        mixer.load_tensor(name, tensor)
    seqs = [torch.randn(n, HIDDEN) for n in (11, 5)]
    states = allocate_states(mixer.dims, 1, 2, torch.float32, "cpu")
    outputs = run_in_steps(mixer, seqs, [1, 0], [8, 5], states)
    for output, seq in zip(outputs, seqs):
        torch.testing.assert_close(output, reference(layer, seq), rtol=1e-4, atol=1e-4)


def test_fork_copies_state():
    layer = hf_layer(2)
    mixer = ours(layer)
    prompt, tail = torch.randn(6, HIDDEN), torch.randn(1, HIDDEN)
    states = allocate_states(mixer.dims, 1, 2, torch.float32, "cpu")
    mixer(prompt, [6], [0], states.conv[0], states.ssm[0])
    states.copy([(0, 1)])
    parent = mixer(tail, [1], [0], states.conv[0], states.ssm[0])
    child = mixer(tail, [1], [1], states.conv[0], states.ssm[0])
    torch.testing.assert_close(parent, child)
    expected = reference(layer, torch.cat([prompt, tail]))[-1:]
    torch.testing.assert_close(child, expected, rtol=1e-4, atol=1e-4)
    states.reset([1])
    assert not states.conv[:, 1].any() and not states.ssm[:, 1].any()


def test_layers_and_sizes_read_from_the_config():
    config = hf_config(num_hidden_layers=4, layer_types=None, full_attention_interval=2)
    raw = {**config.to_dict(), "model_type": "qwen3_next"}
    assert deltanet_layers(raw) == [True, False, True, False]
    dims = deltanet_dims(raw)
    assert (dims.conv_dim, dims.recurrent_elements()) == (2 * 16 + 24, 4 * 8 * 6)
    states = allocate_states(dims, 2, 3, torch.bfloat16, "cpu")
    assert states.conv.shape == (2, 3, dims.conv_dim, 3) and states.conv.dtype == torch.bfloat16
    assert states.ssm.shape == (2, 3, 4, 8, 6) and states.ssm.dtype == torch.float32


def test_a_wrong_shape_is_refused():
    mixer = ours(hf_layer())
    with pytest.raises(CheckpointError, match="in_proj_ba"):
        mixer.load_tensor("in_proj_ba.weight", torch.zeros(3, HIDDEN))
    with pytest.raises(CheckpointError, match="conv1d"):
        mixer.load_tensor("conv1d.weight", torch.zeros(5, 1, 4))
    with pytest.raises(CheckpointError, match="not a gated DeltaNet tensor"):
        mixer.load_tensor("q_proj.weight", torch.zeros(3, HIDDEN))
