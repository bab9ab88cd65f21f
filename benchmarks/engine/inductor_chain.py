"""The decoder's chain around attention, kvpager's against torch.compile's (inductor).

    python -m benchmarks.engine.inductor_chain [--tokens 1 8 64 256] [--dtype float32 bfloat16]

Every layer's norms, four matmuls, rotary and SiLU-and-mul, over all of SmolLM2-135M's 30
layers (seeded random weights of its shapes), for one step of `--tokens` tokens:
- kvpager: the executor's own DecoderLayer.forward (C layer ops, oneDNN-packed matmuls);
- inductor: the same chain on the ops' torch twins, `torch.compile(fullgraph=True)` with
  weight freezing (inductor packs the weights and fuses the elementwise ops into C++ loops),
  one compile per token count (`--per-layer`: one graph a layer, called in turn).
Attention is left out of both: q stands in for its output. Best of `--repeats` calls, the two
alternating twice; this host's speed drifts, so read the ratios.
"""

import argparse
import sys
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from kvpager.engine.config import ModelConfig
from kvpager.engine.download import resolve_model
from kvpager.engine.model.decoder import DecoderLayer, RopeRows
from kvpager.engine.model.sharding import Shard
from kvpager.kernels import reference
from kvpager.kernels.backend import KernelOps, get_kernel_ops
from kvpager.kernels.isa import isa_flags
from torch import nn

from benchmarks.kernels.cpu_kernels import best_ms


class TorchChain(nn.Module):
    """The layers' chain in plain torch, on copies of their weights, for inductor to compile."""

    NAMES = ("input_norm", "qkv_weight", "o_weight", "post_attention_norm", "gate_up_weight")

    def __init__(self, layers: list[DecoderLayer]) -> None:
        super().__init__()
        first = layers[0]
        self.sizes = [first.q_size, first.kv_size, first.kv_size]
        self.head_dim, self.eps = first.head_dim, first.eps
        self.weights = nn.ParameterList(
            nn.Parameter(getattr(layer, name).detach().clone(), requires_grad=False)
            for layer in layers
            for name in (*self.NAMES, "down_weight")
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        tokens, delta = x.shape[0], None
        shape = (tokens, -1, self.head_dim)
        for i in range(0, len(self.weights), 6):
            norm1, qkv_w, o_w, norm2, gate_up_w, down_w = self.weights[i : i + 6]
            h, x = reference.add_rms_norm_ref(x, delta, norm1, self.eps)
            q, k, v = F.linear(h, qkv_w).split(self.sizes, -1)
            q, k = reference.rotary_ref(q.view(shape), k.view(shape), cos, sin)
            attn = q.reshape(tokens, -1) + (k.sum() + v.sum()) * 0  # keeps k and v computed
            h, x = reference.add_rms_norm_ref(x, F.linear(attn, o_w), norm2, self.eps)
            delta = F.linear(reference.silu_and_mul_ref(F.linear(h, gate_up_w)), down_w)
        return x, delta


def _query_as_output(
    q, k, v, layer_cache, meta, window=0, softcap=0.0, k_scale=1.0, v_scale=1.0, sinks=None
) -> torch.Tensor:
    """Stands in for paged attention: q, rotated, as the layer's attention output."""
    return q


def kvpager_chain(layers: list[DecoderLayer], x, cos, sin):
    """The executor's own DecoderLayer.forward, with q standing in for attention."""
    delta = None
    for layer in layers:
        x, delta = layer(x, delta, RopeRows((cos, sin), None), _query_as_output, None, None)
    return x, delta


def build_layers(config: ModelConfig, dtype: torch.dtype, ops: KernelOps) -> list[DecoderLayer]:
    shard, layers = Shard.of(config), []
    for layer_idx in range(config.num_layers):
        layer = DecoderLayer(config, layer_idx, dtype, ops, shard, None)
        for param in layer.parameters():
            param.data.normal_(0, 0.02)
        layer.input_norm.data.fill_(1)
        layer.post_attention_norm.data.fill_(1)
        layers.append(layer)
    return layers


def step_inputs(tokens: int, config: ModelConfig, dtype: torch.dtype):
    x = torch.randn(tokens, config.hidden_size, dtype=dtype)
    angles = torch.rand(tokens, config.head_dim // 2)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    return x, cos, sin


def per_layer_graphs(chains: list[TorchChain]):
    """One compiled graph a layer, called in turn, as an executor would around attention."""
    limit = 4 * len(chains)  # every layer's graph is a cache entry of the same code object
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.recompile_limit = limit
    graphs = [torch.compile(chain, dynamic=False, fullgraph=True) for chain in chains]

    def run(x, cos, sin):
        for graph in graphs:
            x, delta = graph(x, cos, sin)
            x = x + delta
        return x, torch.zeros_like(x)

    return run


@torch.inference_mode()  # inductor freezes (and packs) weights only without autograd
def compare(config, dtype: torch.dtype, tokens_list: list[int], repeats: int, per_layer: bool):
    ops = get_kernel_ops("cpu")
    layers = build_layers(config, dtype, ops)
    # the chains copy the plain weights, which packing releases
    chains = [TorchChain([layer]).eval() for layer in layers] if per_layer else [TorchChain(layers)]
    for layer in layers:
        layer.build_matmuls(pack=True)
    inductor_config.freezing = True  # weights become constants inductor may pack
    if per_layer:
        compiled = per_layer_graphs(chains)
    else:
        compiled = torch.compile(chains[0].eval(), dynamic=False, fullgraph=True)
    for tokens in tokens_list:
        print(_row(layers, compiled, step_inputs(tokens, config, dtype), repeats), flush=True)


def _row(layers: list[DecoderLayer], compiled, inputs, repeats: int) -> str:
    x, cos, sin = inputs
    start = time.perf_counter()
    theirs = compiled(x, cos, sin)
    compile_s = time.perf_counter() - start
    ours = kvpager_chain(layers, x.clone(), cos, sin)
    diff = (sum(theirs) - sum(ours)).abs().max().item()
    kv, ind = [], []
    for _ in range(2):
        kv.append(best_ms(lambda: kvpager_chain(layers, x.clone(), cos, sin), repeats))
        ind.append(best_ms(lambda: compiled(x, cos, sin), repeats))
    return (
        f"{str(x.dtype)[6:]:>8} {x.shape[0]:5d} tokens: kvpager {min(kv):7.2f} ms, inductor "
        f"{min(ind):7.2f} ms ({min(ind) / min(kv):.2f}x kvpager's time; first call with "
        f"its compile {compile_s:.0f} s, max |diff| {diff:.1e})"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--per-layer", action="store_true", help="a compiled graph per layer")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"ISA: {' '.join(isa_flags())}; torch {torch.__version__}, {args.threads} threads")
    config = ModelConfig.from_path(resolve_model(args.model))
    for name in args.dtype:
        compare(config, getattr(torch, name), args.tokens, args.repeats, args.per_layer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
