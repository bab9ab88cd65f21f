"""The long-tailed workload offline with the whole decoder compiled by inductor, against eager.

    python -m benchmarks.engine.compiled_decoder [--dtype bfloat16] [--order eager compiled]

A measurement, not an engine mode: each `--order` entry runs in a fresh process, builds the
offline LLM as run.py does and, for "compiled", swaps the executor's decoder for one
`torch.compile` graph of it (plain-torch layer ops, frozen weights that inductor packs for
oneDNN, a dynamic token dimension) around paged attention as a custom op, which reads the
step's cache and metadata from a context set before each call. The lm_head, sampling and the
scheduler are the engine's own. Two rounds; the first pays the compiles (the dynamic graph,
then the one for single-token steps). Prints tok/s and forward seconds split at 8 tokens.
"""

import argparse
import collections
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from kvpager.engine.download import resolve_model
from kvpager.engine.model import decoder as decoder_module
from kvpager.kernels import reference
from kvpager.kernels.isa import isa_flags
from kvpager.services.bench.offline import warm_up
from torch import nn

from benchmarks.common.config import BenchConfig
from benchmarks.engine.kvpager_offline import build_llm
from benchmarks.engine.op_breakdown import workload_requests

STEP = {}  # the running step's attention, KV cache and metadata, for the custom op
TIMES: collections.Counter = collections.Counter()
SMALL_STEP = 8  # tokens: steps up to this size stream every weight from DRAM


@torch.library.custom_op("kvpager_bench::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return STEP["attention"](q, k, v, STEP["kv_cache"][layer], STEP["meta"])


@paged_attention.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class DecoderGraph(nn.Module):
    """Decoder.forward in plain torch, attention as the custom op: what inductor compiles."""

    def __init__(self, decoder: decoder_module.Decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        dtype, tokens = d.embed_tokens.dtype, input_ids.shape[0]
        x, delta = F.embedding(input_ids, d.embed_tokens), None
        cos, sin = d.cos[positions].to(dtype), d.sin[positions].to(dtype)
        for i, layer in enumerate(d.layers):
            h, x = reference.add_rms_norm_ref(x, delta, layer.input_norm, layer.eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], -1)
            shape = (tokens, -1, layer.head_dim)
            q, k = reference.rotary_ref(q.view(shape), k.view(shape), cos, sin)
            attn = paged_attention(q, k, v.reshape(shape), i).reshape(tokens, layer.q_size)
            h, x = reference.add_rms_norm_ref(
                x, F.linear(attn, layer.o_weight), layer.post_attention_norm, layer.eps
            )
            gate_up = F.linear(h, layer.gate_up_weight)
            delta = F.linear(reference.silu_and_mul_ref(gate_up), layer.down_weight)
        return reference.add_rms_norm_ref(x, delta, d.norm, d.config.rms_norm_eps)[0]


class TimedForward:
    """Stands in for the executor's decoder: the decoder itself, or `graph` (a DecoderGraph,
    compiled or not) around the engine's attention; times each forward."""

    def __init__(self, decoder: decoder_module.Decoder, graph: nn.Module | None = None) -> None:
        self.decoder, self.graph = decoder, graph

    def __call__(
        self, input_ids, positions, kv_cache, attention, meta, recurrent=None
    ) -> torch.Tensor:
        start = time.perf_counter()
        if self.graph is None:
            out = self.decoder(input_ids, positions, kv_cache, attention, meta, recurrent)
        else:
            assert recurrent is None, "the decoder graph has no recurrent layers"
            # inductor's config is thread-local, and the executor steps on its own thread:
            # set in the main thread, freezing never reaches the compile (aten mm, unpacked)
            inductor_config.freezing = True
            STEP.update(attention=attention, kv_cache=kv_cache, meta=meta)
            out = self.graph(input_ids, positions)
        seconds = time.perf_counter() - start
        TIMES["small" if input_ids.shape[0] <= SMALL_STEP else "large"] += seconds
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.compute_logits(hidden)


@contextlib.contextmanager
def plain_layer_weights() -> Iterator[None]:
    """Decoders built inside keep their layers' plain weights, which the graph needs
    (inductor packs its own copies); the lm_head stays packed as the engine has it."""
    original = decoder_module.Decoder.build_matmuls

    def build_matmuls(self, pack: bool = True) -> None:
        for layer in self.layers:
            layer.build_matmuls(False)
        self.lm_head_matmul, _ = decoder_module.make_linear(self.lm_head, None, pack)

    decoder_module.Decoder.build_matmuls = build_matmuls
    try:
        yield
    finally:
        decoder_module.Decoder.build_matmuls = original


def use_graph(llm, compiled: bool) -> None:
    """Swap the LLM's decoder (built under plain_layer_weights) for its DecoderGraph."""
    decoder = llm.executor.model
    graph = DecoderGraph(decoder).eval()
    if compiled:
        graph = torch.compile(graph, fullgraph=True, dynamic=True)
    llm.executor.model = TimedForward(decoder, graph)


def run_mode(mode: str, dtype: str, threads: int) -> None:
    torch.set_num_threads(threads)
    model_path = resolve_model("smollm2-135m-instruct")
    prompts, params = workload_requests(model_path, 64, "sharegpt-like")
    config = BenchConfig(model_path, dtype=dtype, num_threads=threads)
    if mode == "compiled":
        with plain_layer_weights():
            llm = build_llm(config)
        use_graph(llm, compiled=True)
    else:
        llm = build_llm(config)
        llm.executor.model = TimedForward(llm.executor.model)
    start = time.perf_counter()
    warm_up(llm)
    print(f"{mode}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
    for round_idx in range(2):
        TIMES.clear()
        llm.scheduler.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(
            f"{mode} {dtype} round {round_idx + 1}: {tokens} tokens in {elapsed:.1f} s = "
            f"{tokens / elapsed:.1f} tok/s; forward {TIMES['small']:.2f} s in steps of <= "
            f"{SMALL_STEP} tokens, {TIMES['large']:.2f} s in larger ones",
            flush=True,
        )
    llm.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--order", nargs="+", default=["eager", "compiled"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:  # one entry of --order, in its own process
        run_mode(args.mode, args.dtype, args.threads)
        return 0
    print(f"ISA: {' '.join(isa_flags())}; torch {torch.__version__}, {args.threads} threads")
    for mode in args.order:
        command = [sys.executable, "-m", __spec__.name, "--mode", mode, "--dtype", args.dtype]
        subprocess.run([*command, "--threads", str(args.threads)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
